"""The accuracy check's plots in report.html: score per dtype with its 95% interval, the change against the
baseline dtype with the paired 95% interval, drift (mean KL, top-1 agreement) per dtype, drift by position, and
kv_needle's grid per dtype as a heatmap beside the baseline's (``needle_view.py``)."""

from __future__ import annotations

from kvdiag.checks.accuracy.needle_view import heatmaps
from kvdiag.checks.sweep.drift_position import position_plots
from kvdiag.checks.sweep.stats import Z95
from kvdiag.render.svg import bar_chart


def plots(cases, suffix: str = "") -> list[str]:
    acc = [c for c in cases if c.check == "accuracy"]
    if not acc:
        return []
    tasks = list(dict.fromkeys(t for c in acc for t in (c.metrics.get("scores") or {})))
    out = []
    for task in tasks:
        metric = next(m for c in acc for m in (c.metrics.get("scores") or {}).get(task, {}))
        bars = []
        for c in acc:
            sc = (c.metrics.get("scores") or {}).get(task, {}).get(metric)
            if sc is None or not isinstance(sc.get("score"), (int, float)):
                bars.append((f"{c.kv_dtype} ({c.status})", None, None, None))
                continue
            se = sc.get("stderr") if isinstance(sc.get("stderr"), (int, float)) else None
            bars.append((c.kv_dtype, sc["score"], None if se is None else sc["score"] - Z95 * se,
                         None if se is None else sc["score"] + Z95 * se))
        if all(b[1] is None or 0 <= b[1] <= 1 for b in bars):  # a proportion: the interval stays in [0, 1]
            bars = [(lb, v, None if lo is None else max(lo, 0.0), None if hi is None else min(hi, 1.0))
                    for lb, v, lo, hi in bars]
        out.append(bar_chart(f"{task} {metric} per kv dtype{suffix} (± 95% interval from stderr)", metric, bars,
                             xlabel="kv-cache dtype", colors=list(range(len(bars)))))
        deltas = []
        for i, c in enumerate(acc):
            row = next((r for r in c.metrics.get("comparisons") or () if r.get("task") == task
                        and r.get("metric") == metric), None)
            if row is not None:
                deltas.append(((f"{c.kv_dtype} ({row['verdict']})", row.get("delta"), row.get("ci_low"),
                                row.get("ci_high")), i))
        if deltas:
            out.append(bar_chart(f"{task} {metric}: change vs baseline dtype{suffix} (paired 95% CI)",
                                 f"Δ {metric}", [d for d, _ in deltas], xlabel="kv-cache dtype (verdict)",
                                 colors=[i for _, i in deltas], ref=0.0, symmetric=0.05))
    drifted = [(i, c) for i, c in enumerate(acc) if isinstance(c.metrics.get("mean_kl"), (int, float))]
    if drifted:
        out.append(bar_chart(f"drift: mean KL(baseline ‖ dtype) per position{suffix}", "mean KL (nats)",
                             [(c.kv_dtype, c.metrics["mean_kl"], None, None) for _, c in drifted],
                             xlabel="kv-cache dtype", colors=[i for i, _ in drifted]))
        out.append(bar_chart(f"drift: top-1 agreement with the baseline{suffix}", "top-1 agreement",
                             [(c.kv_dtype, c.metrics.get("top1_agreement"), None, None) for _, c in drifted],
                             xlabel="kv-cache dtype", colors=[i for i, _ in drifted], ref=1.0))
    return out + position_plots(acc, suffix) + heatmaps(acc, suffix)
