"""A case failed on its drift beyond its dtype family's limits (accuracy's ``drift``, a dtypes row ``wrong`` by them)
gets a reproducer on the builtin engine (kvdiag/checks/sweep/drift_repro.py, kvdiag.proof's drift_script.py): the
baseline's and the dtype's engines score the drift probe's continuations teacher-forced, and the whole distributions
are held to the limits kvdiag judged by. The oracle is the builtin engine's fault ``v_with_k_scales`` (V dequantized
with K's scales) in the script's process: beyond the int8_per_token_head limits with it, within them without.
tiny-llama, two prompts."""

from __future__ import annotations

from kvdiag.case import Case
from kvdiag.results import RunRecord


def drift_cases(check: str):
    """The baseline and an int8_per_token_head case failed on drift, as ``check`` records them on the builtin
    engine."""
    from dataclasses import asdict

    from kvdiag.assets import TINY_MODEL
    from kvdiag.checks.sweep.drift import FAMILY_LIMITS

    def start(kv_dtype):
        spec = {"model": str(TINY_MODEL), "kv_cache_dtype": kv_dtype, "num_blocks": 64, "device": "cpu"}
        return {"engine": "builtin", "spec": spec, "env": {"OMP_NUM_THREADS": "1"}}

    params = {"num_prompts": 2}
    base = Case(check, "builtin", str(TINY_MODEL), "auto", "t", params={**params, "role": "baseline"},
                id=f"{check}/auto").result("pass", metrics={"replay": start("auto"), "started": True,
                                                             "finite": True, "model_dtype": "bfloat16"})
    rec = Case(check, "builtin", str(TINY_MODEL), "int8_per_token_head", "t", params={**params, "role": "test"},
               id=f"{check}/int8_per_token_head").result("fail", metrics={
                   "replay": start("int8_per_token_head"), "started": True, "finite": True, "row": "wrong",
                   "model_dtype": "bfloat16", "drift_limits": asdict(FAMILY_LIMITS["int8_per_token_head"])})
    rec.add("error", "drift" if check == "accuracy" else "wrong", "mean_kl 0.33 beyond the int8_per_token_head limit")
    return RunRecord(f"kvdiag {check}", "", [base, rec], {}), rec


def test_the_drift_script_exceeds_the_limits_with_the_fault_and_stays_within_without(tmp_path):
    from kvdiag.checks.registry import get
    from kvdiag.engines.builtin import TRAITS
    from kvdiag.proof.runs import attempts, patched_env, write_script

    run, rec = drift_cases("accuracy")
    path = write_script(tmp_path, rec.id, get("accuracy").reproducer(rec, run))
    patch = patched_env(tmp_path / "patch", TRAITS.fault_patch(["v_with_k_scales"], "int8_per_token_head"))
    (code, out, _), = attempts(path, 120, env=patch, tries=1)
    assert code == 1 and "mean_kl" in out and "beyond the int8_per_token_head limit 0.002" in out, out
    assert "expected: within kvdiag's int8_per_token_head limits: mean KL <= 0.002" in out
    (code, out, _), = attempts(path, 120, tries=1)
    assert code == 0 and "NOT REPRODUCED: within kvdiag's int8_per_token_head limits" in out, out


def test_a_dtypes_row_wrong_by_its_drift_gets_the_same_script_on_the_builtin_engine_only():
    from kvdiag.checks.dtypes.repro import script

    run, rec = drift_cases("dtypes")
    ns: dict = {"__name__": "reproducer"}
    exec(compile(script(rec, run), "r.py", "exec"), ns)
    assert len(ns["CASE"]["contexts"]) == 2 and ns["CASE"]["limits"]["family"] == "int8_per_token_head"
    assert ns["CASE"]["engines"]["baseline"]["spec"]["kv_cache_dtype"] == "auto"
    run.cases[0].metrics["replay"] = {"engine": "vllm", "llm": {"model": "/m"}, "sampling": {}, "env": {}}
    assert script(rec, run) is None  # vLLM gives no whole distribution of a prompt's tokens
