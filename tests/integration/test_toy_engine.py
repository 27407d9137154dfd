"""A new engine is one folder and one line: tests/support/toy_engine/ (pure Python, no torch) follows the runtime
protocol and
declares its traits; ``-e toy_engine:ToyEngine`` registers it. kvdiag runs a real check through it, checks its ``-a``
keys before any worker starts, lists and runs its self-test, and names its version in the report: all from what the
engine says (``ToyEngine.traits``), no file of kvdiag edited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOY = "toy_engine:ToyEngine"  # the one line: tests/ on PYTHONPATH, the factory by its module path


def kvdiag(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "support"), str(ROOT)]), "CI": "true",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    from kvdiag.cli.app import main

    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_the_toy_follows_the_protocol_and_kvdiag_reads_its_declared_traits():
    from toy_engine import ToyEngine

    from kvdiag.engines import base
    from kvdiag.engines.traits import EngineTraits

    assert isinstance(ToyEngine(), base.Engine)
    traits = base.engine_traits(TOY)
    assert traits is ToyEngine.traits and isinstance(traits, EngineTraits)
    assert base.engine_arg_names(TOY) == ["seed_offset"] and base.engine_dtypes(TOY) == ["auto"]
    assert base.reported_versions(TOY, {}) == {"toy_engine": "0.1"}
    # what it does not declare keeps EngineTraits' safe defaults
    assert base.preload_modules(TOY) == () and base.gpus_spanned(TOY, {"seed_offset": 3}) == 1
    assert not base.cpu_only(TOY) and not base.one_engine_per_gpu_process(TOY)
    assert base.shared_gpu_bytes(TOY, "m", {}, 0) is None and base.reproducer(TOY, "restart") is None


def test_the_toys_arguments_and_self_test_come_from_its_traits(capsys):
    code, _, err = run_cli(capsys, "wake-cycle", "-e", TOY, "-a", "seed_ofset=2")
    assert code == 2 and err.strip().splitlines() == [
        f"kvdiag: error: --engine-arg 'seed_ofset' is not an argument of engine '{TOY}' (did you mean "
        "'seed_offset'?); valid: seed_offset"]
    code, out, _ = run_cli(capsys, "selftest", "-e", TOY, "--list", "-f", "json")
    listed = json.loads(out)
    assert code == 0 and listed["engine"] == TOY
    assert [(f["fault"], f["bug_class"], f["intended"]) for f in listed["faults"]] == [("wake_reseeds", "S2",
                                                                                        "wake-cycle")]


@pytest.mark.slow
def test_kvdiag_runs_a_check_and_the_self_test_through_the_toy(tmp_path):
    """wake-cycle passes on the toy (its sleep keeps its seed); the self-test catches its one fault with wake-cycle,
    counted as fired from the toy's own fault_state, and the clean toy passes."""
    r = kvdiag("wake-cycle", "-e", TOY, "-d", "auto", "-a", "seed_offset=2", "-o", str(tmp_path / "wc"))
    assert r.returncode == 0, r.stderr[-3000:]
    (case,) = json.loads((tmp_path / "wc" / "run.json").read_text())["cases"]
    assert case["engine"] == TOY and case["status"] == "pass" and case["environment"]["toy_engine"] == "0.1"
    r = kvdiag("report", str(tmp_path / "wc"), "--write")
    assert r.returncode == 0 and "toy_engine 0.1" in (tmp_path / "wc" / "report.md").read_text().replace("`", "")
    r = kvdiag("selftest", "-e", TOY, "-f", "json", "-o", str(tmp_path / "st"))
    assert r.returncode == 0, r.stderr[-3000:]
    a = json.loads(r.stdout)["analysis"]["selftest"]
    (row,) = a["faults"]
    assert a["ok"] and a["engine"] == TOY and a["clean"]["wake-cycle"]["mark"] == "pass"
    assert (row["fault"], row["status"], row["fired"]) == ("wake_reseeds", "caught", 1)
    assert "divergence" in row["cells"]["wake-cycle"]["finding"]
