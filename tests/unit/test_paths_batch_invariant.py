"""`kvdiag paths --batch-invariant`: every engine of a case starts with the engine's batch-invariant environment
(vLLM: VLLM_BATCH_INVARIANT=1), which its reproducer carries; the floor must then be 0 and any difference fails the
path; where the engine or platform has no such mode the case is unsupported, in one line, before any engine
starts. Real vLLM on an H200 is the GPU suite's (the report names the command)."""

from __future__ import annotations

import os
import shlex
from types import SimpleNamespace

import pytest

from kvdiag.assets import TINY_MODEL
from kvdiag.case import Case
from kvdiag.engines.protocol import Completion


def _case(engine: str, **params) -> Case:
    return Case("paths", engine, str(TINY_MODEL), "auto", "t", params={"path": "cold", **params}, id="c")


def test_the_builtin_engine_has_no_batch_invariant_mode_and_says_so_in_one_line():
    from kvdiag.checks.paths.run import run

    rec = run(_case("builtin", device="cpu", batch_invariant=True), None)
    assert rec.status == "unsupported"
    assert rec.metrics["reason"] == "--batch-invariant: the engine has no batch-invariant mode"


def test_vllm_on_the_cpu_is_unsupported_before_an_engine_starts(monkeypatch):
    from kvdiag.checks.paths.run import run

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    rec = run(_case("vllm", device="cpu", batch_invariant=True), None)
    assert rec.status == "unsupported"
    assert "compute capability 9.0" in rec.metrics["reason"] and "\n" not in rec.metrics["reason"]
    assert "VLLM_BATCH_INVARIANT" not in os.environ


def test_on_a_gpu_the_engines_start_batch_invariant_and_the_reproducer_carries_it(monkeypatch, tmp_path):
    """The worker puts vLLM's switch into its environment before any engine of the case starts (here the case
    stops at its path config, before the start); the engine's replay records it, so the script sets it too."""
    from kvdiag.checks.paths import run as worker
    from kvdiag.checks.paths.repro import script
    from kvdiag.engines import vllm
    from kvdiag.engines.vllm import repro
    from kvdiag.results import RunRecord

    class Traits(vllm.VllmTraits):
        def path_config(self, path, need):
            return "stopped before the engine start"

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setattr(vllm, "cpu_only", lambda: False)
    monkeypatch.setattr("kvdiag.engines.base.engine_traits", lambda name: Traits())
    rec = worker.run(_case("vllm", device="cuda", batch_invariant=True), None)
    assert rec.metrics["reason"] == "stopped before the engine start"
    assert os.environ.get("VLLM_BATCH_INVARIANT") == "1"

    replay = repro.replay({"model": "/m"}, {})  # what VllmEngine.start records of this process
    assert replay["env"]["VLLM_BATCH_INVARIANT"] == "1"
    ref = Case("paths", "vllm", "/m", "auto", "t", params={"path": "cold"}, id="r").result("pass", metrics={
        "path": "cold", "role": "reference", "replay": replay, "prompts": [[1, 2]], "completions": []})
    path = Case("paths", "vllm", "/m", "auto", "t", params={"path": "chunked-prefill", "max_tokens": 4},
                id="p").result("fail", metrics={"path": "chunked-prefill", "role": "path", "replay": replay,
                                                "prompts": [[1, 2]], "tolerance": 0.0, "completions": []})
    text = script(path, RunRecord("kvdiag paths", "", [ref, path], {}, run_dir=str(tmp_path)))
    ns: dict = {"__name__": "reproducer"}
    exec(compile(text, "repro.py", "exec"), ns)  # the script sets each engine's env before it imports vLLM
    assert {k: e["env"].get("VLLM_BATCH_INVARIANT") for k, e in ns["CASE"]["engines"].items()} == {
        "reference": "1", "path": "1"}


def _out(*logprobs):
    return [Completion([1, 2], [5, 6], list(logprobs), [{5: logprobs[0], 7: logprobs[0] - 1.0},
                                                         {6: logprobs[1], 7: logprobs[1] - 1.0}])]


@pytest.mark.parametrize("invariant, floor, status, warned", [
    (False, 0.0, "pass", False),  # a difference far below --logprob-tol: noise
    (True, 0.0, "fail", False),  # the floor is 0: any difference is the path's
    (True, 1e-3, "fail", True),  # the engine's own runs differed: said, and the path still held to 0
])
def test_under_batch_invariance_any_difference_fails_and_a_floor_above_0_is_said(invariant, floor, status, warned):
    from kvdiag.checks.paths.catalogue import PATHS
    from kvdiag.checks.paths.floor import Floor
    from kvdiag.checks.paths.params import PathsParams
    from kvdiag.checks.paths.verdict import judge_into

    p = PathsParams(batch_invariant=invariant)
    rec = _case("vllm").result("pass")
    trial = SimpleNamespace(counted=None, notes={})
    judge_into(rec, p, PATHS["chunked-prefill"], Floor(max_dlogprob=floor, runs=3, parts={"second cold run": floor}),
               _out(-0.5, -0.25), _out(-0.5, -0.25 + 1e-6), trial)
    assert rec.status == status
    assert any(f.kind == "logprob_drift" for f in rec.findings) is invariant
    said = [f for f in rec.findings if f.kind == "batch_invariance"]
    assert bool(said) is warned
    if warned:
        assert said[0].severity == "warning"
        assert said[0].message.startswith("under batch invariance the floor is 0.001, not 0, set by the second")


def test_a_gpu_below_compute_capability_9_is_unsupported_in_the_engine_start():
    from kvdiag.engines.vllm.engine import _batch_invariance
    from kvdiag.errors import EngineUnsupported

    t4 = SimpleNamespace(is_cuda=lambda: True, has_device_capability=lambda cap: cap <= 75,
                         get_device_name=lambda: "Tesla T4", device_type="cuda")
    with pytest.raises(EngineUnsupported, match="compute capability 9.0 or higher.*Tesla T4"):
        _batch_invariance(t4)


def test_a_worker_forked_after_vllm_read_the_switch_still_runs_batch_invariant(monkeypatch):
    """vLLM reads VLLM_BATCH_INVARIANT where its batch_invariant module is imported: in the fork server, before
    the case set it. The engine's start sets vLLM's flag again from the worker's environment."""
    import sys

    from kvdiag.engines.vllm.adapt import hold_batch_invariance

    read_early = SimpleNamespace(VLLM_BATCH_INVARIANT=False)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.batch_invariant", read_early)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    hold_batch_invariance()
    assert read_early.VLLM_BATCH_INVARIANT is True


def test_the_reproducer_switches_batch_invariance_on_itself_and_says_so(tmp_path, monkeypatch):
    """A case kvdiag ran batch-invariant: its script sets vLLM's switch in its own environment before vLLM is
    imported (here the engine's recorded environment lacks it, and the stand-in path engine starts only with it) and
    says so first; a crash's plain command sets it too."""
    from test_proof import records, run_script

    from kvdiag.checks.paths.repro import script
    from kvdiag.engines import vllm
    from kvdiag.engines.vllm import repro
    from kvdiag.results import RunRecord

    monkeypatch.setattr(vllm, "cpu_only", lambda: False)  # the switch is vLLM's on a GPU only
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    ref, rec = records("chunked-prefill", "invariant_only")
    assert "'batch_invariance': None" in script(rec, RunRecord("kvdiag paths", "", [ref, rec], {}))
    rec.params["batch_invariant"] = True
    (tmp_path / "repro.py").write_text(script(rec, RunRecord("kvdiag paths", "", [ref, rec], {})))
    p = run_script(tmp_path / "repro.py")
    assert p.returncode == 0 and "NOT REPRODUCED" in p.stdout, p.stdout + p.stderr
    assert "batch-invariant, as kvdiag ran it (paths --batch-invariant): VLLM_BATCH_INVARIANT=1 set in this " \
           "script's environment before vLLM is imported" in " ".join(p.stdout.split())

    assert "VLLM_BATCH_INVARIANT" not in repro.command({"model": "/m"}, generate=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # as the worker of a batch-invariant case has it
    code = shlex.split(repro.command({"model": "/m"}, True))[2]  # python3 -c CODE
    assert "os.environ['VLLM_BATCH_INVARIANT'] = '1'; from vllm import LLM" in code
