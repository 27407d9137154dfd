"""The wake-cycle check's plots in report.html: memory before sleep, asleep and awake in every cycle, per
sleep level."""

from __future__ import annotations

from collections import defaultdict

from kvdiag.render.memory_charts import MEASURES, memory_lines


def plots(cases, suffix: str = "") -> list[str]:
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
        out += memory_lines(f"wake-cycle {variant}{suffix}", "cycle · before sleep / asleep / awake", rows, measure)
    return out
