"""`kvdiag selftest`: every builtin fault caught by its intended check, the clean engine without findings,
and a blinded detector reported as a missed fault with exit code 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.checks import selftest
from kvdiag.checks.registry import get
from kvdiag.checks.selftest import plan
from kvdiag.dtypes import BUILTIN_DTYPES
from kvdiag.engines.builtin.faults import Faults
from kvdiag.engines.builtin.selftest import CATALOGUE as BUILTIN
from kvdiag.engines.builtin.selftest import FAULTS
from kvdiag.results import CaseResult

ROOT = Path(__file__).resolve().parents[2]


def kvdiag(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=900)


def test_plan_covers_every_fault_switch_and_explains_every_na():
    assert {s for f in FAULTS for s in Faults.expand([f.name])} == set(Faults.names())
    for f in FAULTS:
        assert Faults.parse([f.name]).enabled  # a name the builtin engine takes
        assert next(iter(f.runs)) == f.intended
        na = plan.na_of(f)  # the checks that observe none of what the fault moves
        assert set(f.runs) | set(na) <= set(plan.CHECKS) and not set(f.runs) & set(na)
        assert all(na.values()), f.name
        assert set(f.moves) & get(f.intended).observes, f.name  # its intended check can see it move
        assert all(it.kv_dtype in BUILTIN_DTYPES for its in f.runs.values() for it in its)


def test_every_fault_case_has_the_same_clean_case_and_leaky_faults_get_their_own_worker():
    faults, checks = plan.select(None, None)
    cases = selftest.build_cases(faults, checks, device="cpu")
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids)

    def key(c):
        return c.check, c.kv_dtype, c.params.get("level")

    clean = [c for c in cases if c.params["selftest"] == "clean"]
    faulty = [c for c in cases if c.params["selftest"] != "clean"]
    assert cases[:len(clean)] == clean and all(not c.params["faults"] for c in clean)
    assert {key(c) for c in faulty} <= {key(c) for c in clean}
    for c in faulty:
        f = BUILTIN.fault(c.params["selftest"])
        assert c.params["faults"] == [f.name] and c.check in f.runs
        assert c.group == (f"selftest/{f.name}" if f.leaves_process_state else f"selftest/{c.check}")
    for subject, check in {(c.params["selftest"], c.check) for c in cases if c.check in ("accuracy", "dtypes")}:
        job = [c for c in cases if c.params["selftest"] == subject and c.check == check]
        assert job[0].kv_dtype == "auto" and job[0].params["role"] == "baseline"  # its own baseline, first
    assert all(c.group is None for c in selftest.build_cases(faults, checks, isolate="case"))


def rec(status="pass", *findings, dtype="auto"):
    r = CaseResult(id=f"x/{dtype}", check="x", engine="builtin", model="m", kv_dtype=dtype, status=status)
    for severity, kind in findings:
        r.add(severity, kind, f"{kind} happened")
    return r


def test_cells_count_only_real_detections_and_the_clean_engine_must_pass_without_error_findings():
    f = BUILTIN.fault("global_kv_list")
    jobs = {(f.name, "memleak"): [rec("fail", ("info", "one_time_cost"), ("error", "tensor_survived"))],
            (f.name, "wake-cycle"): [rec("timeout", ("error", "timeout"))]}
    row = selftest.fault_row(f, list(plan.CHECKS), jobs)
    cells = {c: x["mark"] for c, x in row["cells"].items()}
    assert cells == {"accuracy": "n/a", "dtypes": "n/a", "memleak": "caught", "wake-cycle": "missed", "poison": "n/a",
                     "paths": "n/a"}
    assert row["caught_by_intended"] and row["cells"]["memleak"]["finding"] == "auto: tensor_survived: " \
                                                                                "tensor_survived happened"
    assert not selftest.fault_row(f, ["wake-cycle"], jobs)["caught_by_intended"]  # intended check not run
    assert selftest.clean_cell([rec("pass", ("info", "one_time_cost"))])["mark"] == "pass"
    warned = selftest.clean_cell([rec("pass", ("warning", "tensor_survived"))])  # vLLM's 64 KiB Triton cache
    assert warned["mark"] == "warnings" and warned["finding"] == "auto: tensor_survived: tensor_survived happened"
    assert selftest.clean_cell([rec("fail", ("warning", "x"), ("error", "tensor_survived"))])["mark"] == "findings"
    assert selftest.clean_cell([rec("skipped", ("info", "unsupported"))])["mark"] == "findings"  # nothing tested


def test_list_and_bad_names():
    r = kvdiag("selftest", "--list", "-f", "json")
    assert r.returncode == 0, r.stderr
    rows = {x["fault"]: x for x in json.loads(r.stdout)["faults"]}
    assert list(rows) == list(BUILTIN.names) and len(rows) == 17
    assert rows["scale_cache_registry"]["bug_class"] == "S0" and rows["scale_cache_registry"]["intended"] == "memleak"
    assert rows["v_with_k_scales"]["intended"] == "accuracy" and rows["explicit_bf16_rejected"]["intended"] == "dtypes"
    for args, needle in ((["--fault", "nope"], "unknown fault 'nope'; valid: scale_cache_registry, "),
                         (["--check", "memleak,nope"], "unknown check 'nope'; valid: accuracy, dtypes, memleak, "),
                         (["--fault", "stale_views_after_wake", "--check", "memleak"], "intended check 'wake-cycle'")):
        r = kvdiag("selftest", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


@pytest.mark.slow
def test_selftest_catches_every_fault_with_its_intended_check(tmp_path):
    """The real command, as CI runs it: exit 0, the clean engine passes every check, every cell that ran caught."""
    r = kvdiag("selftest", "-f", "json", "-o", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    a = json.loads(r.stdout)["analysis"]["selftest"]
    assert a["ok"] and {c: x["mark"] for c, x in a["clean"].items()} == dict.fromkeys(plan.CHECKS, "pass")
    rows = {x["fault"]: x for x in a["faults"]}
    assert list(rows) == list(BUILTIN.names)
    for name, row in rows.items():
        f = BUILTIN.fault(name)
        assert row["caught_by_intended"], (name, row["cells"][f.intended])
        for check, cell in row["cells"].items():
            assert cell["mark"] == {"run": "caught", "n/a": "n/a", "-": "-"}[plan.cell_plan(f, check)], (name, check)
    finding = {n: rows[n]["cells"][BUILTIN.fault(n).intended]["finding"] for n in rows}
    assert "held by module global kvdiag.engines.builtin.faults._SCALE_CACHES" in finding["scale_cache_registry"]
    assert "Unsupported data type of kv cache: bfloat16" in finding["explicit_bf16_rejected"]
    assert "not bit-identical" in finding["explicit_bf16_misdispatch"]
    assert "gc_frozen" in finding["gc_freeze_not_undone"] and "lru_cache" in finding["lru_cache_bound_method"]
    assert "kv_shaped_survived" in finding["per_layer_side_tensors"] and "_SIDE_TENSORS" in finding[
        "per_layer_side_tensors"]  # split across layers, each under 1%: caught by its shape (issue 67)
    assert finding["v_with_k_scales"].startswith("int8_per_token_head: drift")
    assert (tmp_path / "run" / "run.json").exists() and (tmp_path / "run" / "results.jsonl").exists()
    table = kvdiag("report", str(tmp_path / "run"), "--format", "table").stdout
    assert "selftest (builtin): fault x check" in table and "selftest passed" in table, table  # its own tables


@pytest.mark.slow
def test_a_blinded_detector_shows_as_missed_and_fails_the_selftest(tmp_path):
    """Without memleak's referrer census and its KV identity check the small scale-cache leak goes unnoticed: the
    selftest must say so."""
    r = kvdiag("selftest", "--fault", "scale_cache_registry", "--fault", "gc_freeze_not_undone", "-f", "json",
               "-o", str(tmp_path / "run"), env={"KVDIAG_TEST_DISABLE": "memleak.holders,memleak.kv_identity"})
    assert r.returncode == 1, r.stderr[-3000:]
    a = json.loads(r.stdout)["analysis"]["selftest"]
    rows = {x["fault"]: x for x in a["faults"]}
    assert rows["scale_cache_registry"]["cells"]["memleak"]["mark"] == "missed"
    assert rows["gc_freeze_not_undone"]["cells"]["memleak"]["mark"] == "caught"  # another detector: still seen
    assert a["clean"]["memleak"]["mark"] == "pass" and not a["ok"]
