"""The dtypes check in the worker (the registry's target)."""

from __future__ import annotations

from kvdiag.checks.common import compiled, engine_failed, model_dtype, replay_of, start_or_record
from kvdiag.checks.sweep import drift
from kvdiag.checks.sweep.drift import DRIFT
from kvdiag.checks.sweep.engine_use import acquire_engine, release_engine
from kvdiag.checks.sweep.storage_audit import cache_storage


def run_case(case, ctx):
    """Start the engine with one dtype and probe it (the drift prompts, teacher-forced and greedy)."""
    from kvdiag.checks.prompts import case_prompts

    ctx.stage(case, "engine start")
    engine, refused_rec = start_or_record(case, acquire_engine)
    if refused_rec is not None:
        refused_rec.metrics["row"] = refused_rec.status if refused_rec.status != "error" else "resource"
        return refused_rec
    ctx.stage(case, "drift probe")
    try:
        probe = drift.collect(engine, case_prompts(case))
    except Exception as e:  # noqa: BLE001 - it started, then failed: a crash of this dtype, not of kvdiag
        return engine_failed(case, e, "drift probe", started=True)
    path = ctx.artifact(case, DRIFT)
    drift.save(probe, path)
    rec = case.result("pass", metrics={"started": True, "model_dtype": model_dtype(engine, case),
                                       "compiled": compiled(engine),
                                       "finite": drift.finite(probe), "drift_over": probe["over"],
                                       "storage": cache_storage(engine), "artifacts": {"drift": path.name},
                                       **replay_of(engine, probe["greedy_prompt_ids"])})
    release_engine(case, engine)
    return rec


