"""The memleak check's plots in report.html: memory by cycle and stage, one line per kv dtype."""

from __future__ import annotations

from kvdiag.render.memory_charts import memory_lines


def plots(cases, suffix: str = "") -> list[str]:
    rows = {c.kv_dtype: c.metrics["snapshots"] for c in cases if c.check == "memleak" and c.metrics.get("snapshots")}
    if not rows:
        return []
    return memory_lines(f"memleak{suffix}", "cycle · stage (start, workload, shutdown)", rows)
