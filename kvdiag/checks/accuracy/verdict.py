"""The accuracy analysis in the parent: every dtype's documents paired with the baseline's, the paired test, the
drift, and a verdict per dtype (``checks/sweep/verdicts.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.checks.accuracy import drift_decoded, needle
from kvdiag.checks.sweep import drift, power


def artifact_path(run, rec, kind: str) -> Path:
    return Path(run.run_dir) / "artifacts" / rec.metrics["artifacts"][kind]


def analyze(run, *, baseline: str, max_drop: float, alpha: float, max_kl: float | None = None,
            min_top1: float | None = None, strict: bool = False) -> None:
    """Compare every dtype's case with the baseline case; set verdicts, statuses, findings, run.analysis."""
    from kvdiag.checks.sweep import verdicts

    for rec in run.cases:
        verdicts.reset(rec)
    base = next((c for c in run.cases if c.kv_dtype == baseline and c.params.get("role") == "baseline"), None)
    rows, changed, by_position = [], [], []
    base_ok = base is not None and base.status == "pass"
    base_samples = json.loads(artifact_path(run, base, "samples").read_text()) if base_ok else {}
    base_probe = drift.load(artifact_path(run, base, "drift")) if base_ok else None
    for rec in run.cases:
        if rec is base:
            rows += verdicts.baseline_rows(rec)
            changed.append(rec)  # its grid is the baseline's in kv_needle's analysis
        elif (wrong := drift.wrongly_refused(rec, base)) is not None:
            rec.status = "fail"
            rec.add("error", "wrong", wrong)
            rows += verdicts.failed_rows(rec)
            changed.append(rec)
        elif rec.status != "pass":
            d = _kept_drift(run, rec, base, base_probe, max_kl, min_top1)
            if d is not None:  # a case whose worker died after its drift probe: its drift is shown and judged
                verdicts.add_unchanged(rec, base, d)
                by_position += [r for r in [verdicts.position_row(rec)] if r]
                changed.append(rec)
            rows += verdicts.failed_rows(rec)
        elif not base_ok:
            rec.status = "error"
            rec.add("error", "no_baseline", f"baseline dtype '{baseline}' did not finish; nothing to compare with")
            rows += verdicts.failed_rows(rec)
            changed.append(rec)
        else:
            samples = json.loads(artifact_path(run, rec, "samples").read_text())
            probe = drift.load(artifact_path(run, rec, "drift"))
            d = drift.compare(base_probe, probe)
            drift_decoded.add(d, probe)
            lim = drift.limits_for(rec.kv_dtype, base.metrics.get("model_dtype"),
                                   compiled=drift.compiled_pair(rec, base), max_kl=max_kl, min_top1=min_top1)
            rows += verdicts.judge_case(rec, base, base_samples, samples, d, lim, max_drop=max_drop, alpha=alpha,
                                        strict=strict)
            verdicts.add_unchanged(rec, base, d)
            by_position += [r for r in [verdicts.position_row(rec)] if r]
            changed.append(rec)
    cells = needle.analyze(run, changed, base if base_ok else None)  # kv_needle's grid per dtype
    run.analysis["accuracy"] = {"baseline": baseline, "max_drop": max_drop, "alpha": alpha, "strict": strict,
                                "power": power.POWER, "rows": rows, "drift_by_position": by_position,
                                **({"needle": cells} if cells else {}), "timings": total_timings(run.cases)}


def _kept_drift(run, rec, base, base_probe, max_kl, min_top1) -> dict | None:
    """The drift of a case that did not pass but kept its drift probe (``WorkerContext.keep``: its worker died in
    lm_eval), against the baseline's, judged by its family's limits (``verdicts.judge_kept``); None without one."""
    from kvdiag.checks.sweep import verdicts

    name = (rec.metrics.get("artifacts") or {}).get("drift")
    path = Path(run.run_dir) / "artifacts" / name if name else None
    if base_probe is None or path is None or not path.exists():
        return None
    probe = drift.load(path)
    d = drift.compare(base_probe, probe)
    drift_decoded.add(d, probe)
    lim = drift.limits_for(rec.kv_dtype, base.metrics.get("model_dtype"), compiled=drift.compiled_pair(rec, base),
                           max_kl=max_kl, min_top1=min_top1)
    verdicts.judge_kept(rec, d, lim)
    return d


def total_timings(cases) -> dict:
    """Seconds summed over the cases, per phase (startup = spawn + imports)."""
    out: dict = {}
    for c in cases:
        for k, v in (c.metrics.get("timings") or {}).items():
            out[k] = round(out.get(k, 0.0) + v, 3)
    return out
