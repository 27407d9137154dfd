"""The dtypes check's tables in report.md and report.html: what each kv dtype's cache stores (the storage audit),
and the drift by position against 'auto'."""

from __future__ import annotations

from kvdiag.checks.sweep.drift_position import position_table

STORAGE = ("kv dtype", "result", "stores", "layers (kind, dtype, size)")


def tables(run) -> list[tuple[str, tuple[str, ...], list[list[str]]]]:
    a = run.analysis.get("dtypes")
    if not isinstance(a, dict) or not a.get("rows"):
        return []
    return [("What each kv dtype's cache stores (the storage audit)", STORAGE,
             [[r["kv_dtype"], r["result"], r.get("stores") or "-", r.get("layers") or "-"] for r in a["rows"]]),
            *position_table(a.get("drift_by_position"), "")]
