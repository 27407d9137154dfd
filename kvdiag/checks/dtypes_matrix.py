"""`kvdiag dtypes --check`: the support matrix of an engine's kv dtypes.

For every dtype string the engine knows: does the engine start with it, does a short
greedy generation come back finite, is an explicit unquantized dtype equal to the
model's dtype bit-identical to ``auto``, is the drift against ``auto`` within the
dtype family's limits (KL growing with the position: a ``drift_grows`` warning, the
row still passes). Rows: ``pass``, ``unsupported`` (the engine's own words),
``resource`` (the device ran out of memory: another engine on the GPU, most often; an
error of the run, never ``unsupported``), ``crashed``, ``wrong``. An explicit unquantized
dtype equal to the model's dtype is what ``auto`` stores: refusing it while ``auto`` works
is ``wrong`` (bug S1), not ``unsupported``. Each dtype runs in its own worker, so one bad
dtype never stops the matrix.

Each row also says what the cache really stores, read from the engine's cache tensors
(``kv_blocks()``; nothing for engines without KV access): the element dtype per layer,
bytes per token of K+V and of the scales. A dtype named as quantized that stores layers
at the model's precision gets a ``not_quantized`` warning (the row still passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvdiag.checks import drift
from kvdiag.checks.accuracy import DRIFT, compiled, drift_limit, model_dtype
from kvdiag.checks.common import engine_failed, start_or_record
from kvdiag.checks.engine_use import acquire_engine, release_engine
from kvdiag.checks.registry import Check
from kvdiag.checks.storage_audit import cache_storage, storage_row
from kvdiag.results import NOT_RUN_STATUSES


@dataclass
class DtypesParams:
    max_kl: float | None = drift_limit("max_kl")
    min_top1: float | None = drift_limit("min_top1")


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
                                       "storage": cache_storage(engine), "artifacts": {"drift": path.name}})
    release_engine(case, engine)
    return rec


def analyze(run, *, max_kl: float | None = None, min_top1: float | None = None) -> None:
    from kvdiag.checks.verdicts import position_row, reset
    from kvdiag.results import append_jsonl

    folder = Path(run.run_dir) / "artifacts"
    for rec in run.cases:
        reset(rec)
    base = next((c for c in run.cases if c.params.get("role") == "baseline"), None)
    usable = base is not None and base.status == "pass" and base.metrics.get("finite")
    base_probe = _probe(folder, base) if usable else None
    rows = []
    for rec in run.cases:
        row = {**_row(rec, base, base_probe, folder, max_kl, min_top1), **storage_row(rec)}
        rows.append(row)
        rec.metrics["row"] = row["result"]
        if row["result"] == "wrong":
            rec.status = "fail"
            rec.add("error", "wrong", row["detail"])
        warnings = [("not_quantized", row["not_quantized"], {})] if row["not_quantized"] else []
        warnings += row.pop("drift_warnings")
        for kind, msg, evidence in warnings:
            rec.add("warning", kind, msg, **evidence)
            row["detail"] = "; ".join(x for x in (row["detail"], msg) if x)
        if rec.status in ("pass", "fail"):
            append_jsonl(Path(run.run_dir) / "results.jsonl", rec)
    run.analysis["dtypes"] = {"baseline": base.kv_dtype if base else None, "rows": rows,
                              "drift_by_position": [r for r in map(position_row, run.cases) if r]}


def _row(rec, base, base_probe, folder: Path, max_kl, min_top1) -> dict:
    started = bool(rec.metrics.get("started", rec.status == "pass"))
    row = {"kv_dtype": rec.kv_dtype, "result": "pass", "started": started,
           "finite": rec.metrics.get("finite"), "identical_to_auto": None, "mean_kl": None, "top1_agreement": None,
           "detail": "", "drift_warnings": []}
    first = rec.findings[0].message if rec.findings else ""
    if rec.status in NOT_RUN_STATUSES:
        wrong = drift.wrongly_refused(rec, base)
        if wrong:
            return {**row, "result": "wrong", "detail": wrong}
        return {**row, "result": "unsupported", "detail": rec.metrics.get("reason", first)}
    if rec.status != "pass":
        resource = next((f.message for f in rec.findings if f.kind == "resource"), None)
        if resource:  # out of memory: an error of the run, not the engine refusing the dtype
            return {**row, "result": "resource", "detail": resource}
        return {**row, "result": "crashed", "detail": first or rec.status}
    if not rec.metrics.get("finite"):
        return {**row, "result": "wrong", "detail": "non-finite logprobs from a short greedy generation"}
    if rec is base:
        return {**row, "identical_to_auto": True, "mean_kl": 0.0, "top1_agreement": 1.0}
    if base_probe is None:
        return {**row, "detail": "no usable baseline 'auto' to compare with"}
    d = drift.compare(base_probe, _probe(folder, rec))
    lim = drift.limits_for(rec.kv_dtype, base.metrics.get("model_dtype"), compiled=drift.compiled_pair(rec, base),
                           max_kl=max_kl, min_top1=min_top1)
    rec.metrics.update(drift=d, drift_limits=lim.to_json())
    row.update(identical_to_auto=d["identical"] if lim.family in drift.UNQUANTIZED_FAMILIES else None,
               mean_kl=d["mean_kl"], top1_agreement=d["top1_agreement"], drift_warnings=drift.warnings(d, lim))
    problems = drift.judge(d, lim)
    if problems:
        return {**row, "result": "wrong", "detail": "; ".join(problems)}
    return row


def _probe(folder: Path, rec) -> dict:
    return drift.load(folder / rec.metrics["artifacts"]["drift"])


CHECK = Check(
    "dtypes", "kvdiag.checks.dtypes_matrix:run_case", DtypesParams, timeout=300.0,
    help="The kv dtype support matrix: does the engine start with each dtype, is the output finite, bit-identical "
    "or within drift of 'auto', and what its cache stores.",
    render="kvdiag.report.views:dtypes", plots="kvdiag.report.plots:dtypes_plots",
    cases="kvdiag.run.cases:dtypes_cases", gpu_share=True, selftest={"num_prompts": 2})
