"""The reproducer of a `wrong` dtypes row (kvdiag/checks/dtypes/repro.py): from the baseline's start ('auto') and the
row's own, it shows the row's rule with vLLM alone: refused though it is the model's dtype, non-finite logprobs, or
not bit-identical to 'auto'. The engine is the stand-in vLLM (tests/support/fake_vllm)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.case import Case
from kvdiag.results import RunRecord

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_vllm"
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def replay(**llm) -> dict:
    return {"engine": "vllm", "llm": {"model": "/m", "enforce_eager": True, **llm}, "sampling": {}, "env": {}}


def matrix(kv_dtype: str, fault: str | None, *, started=True, finite=True, identical=False):
    """The baseline row and a `wrong` row as dtypes --check records them (after its analysis)."""
    base = Case("dtypes", "vllm", "/m", "auto", "t", params={"role": "baseline"}, id="dtypes/vllm/m/auto").result(
        "pass", metrics={"started": True, "finite": True, "model_dtype": "bfloat16", "replay": replay(),
                         "prompts": PROMPTS, "row": "pass"})
    metrics = {"started": started, "row": "wrong"}
    if started:
        metrics.update(finite=finite, model_dtype="bfloat16", drift={"identical": identical}, prompts=PROMPTS,
                       replay=replay(kv_cache_dtype=kv_dtype, **({"fake_fault": fault} if fault else {})))
    rec = Case("dtypes", "vllm", "/m", kv_dtype, "t", params={"role": "test"},
               id=f"dtypes/vllm/m/{kv_dtype}").result("fail", metrics=metrics)
    rec.add("error", "wrong", f"{kv_dtype}: wrong")
    return RunRecord("kvdiag dtypes --check -e vllm", "", [base, rec], {}), rec


def run_text(tmp_path, text: str, fault: str | None = None) -> subprocess.CompletedProcess:
    assert "import kvdiag" not in text and "from kvdiag" not in text
    (tmp_path / "r.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": str(FAKE), **({"FAKE_VLLM_FAULT": fault} if fault else {})}
    return subprocess.run([sys.executable, str(tmp_path / "r.py")], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("fault, finite, code", [("drift", True, 1), (None, True, 0), ("nan", False, 1),
                                                 ("drift", False, 0)])
def test_the_script_holds_the_row_to_its_rule(tmp_path, fault, finite, code):
    """The model's own dtype must equal 'auto' bit for bit: a logprob that moves reproduces. A row wrong for NaN
    reproduces on a NaN only: a moved logprob is no NaN."""
    from kvdiag.checks.dtypes.repro import script

    run, rec = matrix("bfloat16", fault, finite=finite)
    p = run_text(tmp_path, script(rec, run))
    assert p.returncode == code, p.stdout + p.stderr
    if fault == "nan":
        assert "non-finite logprob(s)" in p.stdout


def test_a_refusal_of_the_models_own_dtype_is_the_baselines_start_with_it(tmp_path):
    from kvdiag.checks.dtypes.repro import script

    run, rec = matrix("bfloat16", None, started=False)
    text = script(rec, run)
    ns: dict = {"__name__": "reproducer"}
    exec(compile(text, "r.py", "exec"), ns)
    body = shlex.split(ns["CASE"]["command"])[2]
    assert "'kv_cache_dtype': 'bfloat16'" in body and "'enforce_eager': True" in body
    p = run_text(tmp_path, text, fault="refuse")
    assert p.returncode == 1 and "kv_cache_dtype 'bfloat16' is not supported" in p.stdout, p.stdout + p.stderr
    assert run_text(tmp_path, text).returncode == 0


def test_a_row_wrong_by_its_drift_limits_has_no_script():
    from kvdiag.checks.dtypes.repro import script

    run, rec = matrix("fp8", "drift")  # a quantized family: KL and top-1 limits, kvdiag's own measure
    assert script(rec, run) is None
    run, rec = matrix("bfloat16", "drift", identical=True)
    assert script(rec, run) is None


def test_the_builtin_engines_refusal_is_its_start_raising_what_kvdiag_saw(tmp_path):
    """On the builtin engine (no command to run: its API): the baseline's spec with this kv_cache_dtype, started in a
    fresh process, raises the exception kvdiag recorded with the fault's patch in that process (exit 1: vLLM-style
    expected against observed) and starts without it (exit 0). tiny-llama, no call after the start."""
    from kvdiag.assets import TINY_MODEL
    from kvdiag.checks.dtypes.repro import script
    from kvdiag.engines.builtin import TRAITS
    from kvdiag.proof.runs import attempts, patched_env, write_script

    run, rec = matrix("bfloat16", None, started=False)
    spec = {"model": str(TINY_MODEL), "kv_cache_dtype": "auto", "num_blocks": 4, "device": "cpu"}
    run.cases[0].metrics["replay"] = {"engine": "builtin", "spec": spec, "env": {"OMP_NUM_THREADS": "1"}}
    rec.add("info", "unsupported", "Unsupported data type of kv cache: bfloat16", exception="ValueError")
    path = write_script(tmp_path, rec.id, script(rec, run))
    patch = patched_env(tmp_path / "patch", TRAITS.fault_patch(["explicit_bf16_rejected"], "bfloat16"))
    (code, out, _), = attempts(path, 120, env=patch, tries=1)
    assert code == 1, out
    assert "expected: the engine starts with kv_cache_dtype='bfloat16', the model's own dtype" in out
    assert "observed: the engine's start raised ValueError: Unsupported data type of kv cache: bfloat16" in out
    (code, out, _), = attempts(path, 120, tries=1)
    assert code == 0 and "NOT REPRODUCED: nothing raised" in out, out
    rec.findings = [f for f in rec.findings if f.kind != "unsupported"]
    assert script(rec, run) is None  # no exception kept: nothing to hold the start to
