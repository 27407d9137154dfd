"""The dtypes matrix in the parent: a row per dtype against 'auto' (started, finite, identical, drift, what the
cache stores) and its result."""

from __future__ import annotations

from pathlib import Path

from kvdiag.checks.sweep import drift
from kvdiag.checks.sweep.storage_audit import storage_row
from kvdiag.results import NOT_RUN_STATUSES


def analyze(run, *, max_kl: float | None = None, min_top1: float | None = None) -> None:
    from kvdiag.checks.sweep.verdicts import position_row, reset

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
