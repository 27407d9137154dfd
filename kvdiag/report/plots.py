"""The plots of report.html, chosen by what the run holds: one extractor per check.

- memleak: memory by cycle and stage, one line per kv dtype, one chart per measure the run has.
- accuracy: score per dtype with its 95% interval; change against the baseline dtype with the
  paired 95% interval; drift (mean KL, top-1 agreement) per dtype.
- wake-cycle: memory before sleep, asleep and awake in every cycle, per sleep level.
- accuracy and dtypes: drift by position, one chart per scored section (the prompts', the long continuations):
  each dtype's mean KL per position bucket over its first bucket's, against the growth threshold.
"""

from __future__ import annotations

from collections import defaultdict

from kvdiag.report.score_tables import Z95
from kvdiag.report.svg import bar_chart, line_chart

MEASURES = (("rss_mib", "process RSS (MiB)"), ("tensor_mib", "live tensors (MiB)"),
            ("cuda_allocated_mib", "CUDA allocated (MiB)"), ("cuda_reserved_mib", "CUDA reserved (MiB)"),
            ("driver_used_mib", "device memory used, driver (MiB)"), ("nvml_process_mib", "NVML process (MiB)"))


def plots_for(run) -> list[str]:
    from kvdiag.checks.registry import checks, load

    figures: list[str] = []
    present = {c.check for c in run.cases}
    for check in checks().values():  # each check's plots, from its registry entry
        if check.plots and check.name in present:
            for suffix, cases in _groups([c for c in run.cases if c.check == check.name]):
                figures += load(check.plots)(cases, suffix)
    return figures


def _groups(cases) -> list[tuple[str, list]]:
    """Cases per (engine, model); the title suffix names the group when there is more than one."""
    from kvdiag.models import label as model_label

    by = defaultdict(list)
    for c in cases:
        by[(c.engine, model_label(c.model))].append(c)
    if len(by) == 1:
        return [("", next(iter(by.values())))]
    return [(f" ({e}, {m})", cs) for (e, m), cs in by.items()]


def _stage(s: dict) -> str:
    stage = s.get("stage", "?").removeprefix("after-")
    return stage if stage == "baseline" else f"c{s.get('cycle')} {stage}"


def _memory_lines(title: str, xlabel: str, rows: dict[str, list[dict]], measures=MEASURES) -> list[str]:
    """rows: series name -> snapshots; one line chart per measure that any snapshot has."""
    xlabels = list(dict.fromkeys(_stage(s) for snaps in rows.values() for s in snaps))
    out = []
    for key, label in measures:
        series = {}
        for name, snaps in rows.items():
            at = {_stage(s): s.get(key) for s in snaps}
            series[name] = [at.get(x) for x in xlabels]
        if any(v is not None for vs in series.values() for v in vs):
            out.append(line_chart(f"{title}: {label}", label, xlabels, series, xlabel=xlabel))
    return out


def memleak_plots(cases, suffix: str = "") -> list[str]:
    rows = {c.kv_dtype: c.metrics["snapshots"] for c in cases if c.check == "memleak" and c.metrics.get("snapshots")}
    if not rows:
        return []
    return _memory_lines(f"memleak{suffix}", "cycle · stage (start, workload, shutdown)", rows)


def wake_cycle_plots(cases, suffix: str = "") -> list[str]:
    by_level: dict[str, dict] = defaultdict(dict)
    for c in cases:
        if c.check != "wake-cycle" or not c.metrics.get("cycles"):
            continue
        m = c.metrics
        variant = f"level {m.get('level')}" + (" staged" if m.get("staged") else "")
        snaps = [dict(snap, stage=stage, cycle=r["cycle"]) for r in m["cycles"]
                 for stage, snap in (r.get("memory") or {}).items()]
        by_level[variant][c.kv_dtype] = snaps
    out = []
    for variant, rows in by_level.items():
        on_gpu = any(s.get("cuda_allocated_mib") is not None for snaps in rows.values() for s in snaps)
        measure = [m for m in MEASURES if m[0] == ("cuda_allocated_mib" if on_gpu else "tensor_mib")]
        out += _memory_lines(f"wake-cycle {variant}{suffix}", "cycle · before sleep / asleep / awake", rows, measure)
    return out


def accuracy_plots(cases, suffix: str = "") -> list[str]:
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
    return out + position_plots(acc, suffix)


def dtypes_plots(cases, suffix: str = "") -> list[str]:
    return position_plots([c for c in cases if c.check == "dtypes"], suffix)


SECTION_TITLES = {"prompts": "the prompts' continuations", "long": "the long continuations"}


def position_plots(cases, suffix: str = "") -> list[str]:
    """Per scored section, each dtype's mean KL per position bucket divided by its first bucket's (a dtype with no
    KL in its first bucket has no line: the table in the report shows it), and the growth threshold: a line that
    rises is a loss growing with the length of what the cache holds."""
    from kvdiag.checks.drift_position import GROWTH

    judged = [(c.kv_dtype, c.metrics["drift"]["by_position"]) for c in cases
              if (c.metrics.get("drift") or {}).get("by_position")]
    out = []
    for section in dict.fromkeys(s for _, by in judged for s in by):
        spans = sorted({(b["from"], b["to"]) for _, by in judged for b in by.get(section, ())})
        series = {}
        for dtype, by in judged:
            at = {(b["from"], b["to"]): b for b in by.get(section, ()) if b.get("positions")}
            first = at.get(spans[0], {}).get("mean_kl")
            if isinstance(first, (int, float)) and first > 0:
                series[dtype] = [at[s]["mean_kl"] / first if s in at else None for s in spans]
        if series:
            series[f"{GROWTH:g}x (threshold)"] = [GROWTH] * len(spans)
            out.append(line_chart(f"drift by position along {SECTION_TITLES.get(section, section)}{suffix}",
                                  f"mean KL / mean KL at {spans[0][0]}-{spans[0][1]}", [f"{a}-{b}" for a, b in spans],
                                  series, xlabel="token positions (bucket)"))
    return out
