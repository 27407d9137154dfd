"""What every check's ``compare`` rule returns: rows of one comparison (``kvdiag compare``, ``kvdiag ci
--baseline``), and the number helpers they share."""

from __future__ import annotations

import math


def row(case, what: str, old, new, verdict: str, **kw) -> dict:
    """One row of a comparison (a check's compare rule returns a list of these); verdict: regression,
    improvement, ok, new or missing."""
    delta = new - old if isinstance(old, (int, float)) and isinstance(new, (int, float)) else None
    return {"id": case.id, "check": case.check, "kv_dtype": case.kv_dtype, "what": what, "old": old, "new": new,
            "delta": kw.pop("delta", delta), "verdict": verdict, **kw}


def largest(values) -> float:
    vals = [v for v in values or () if finite(v)]
    return max(vals) if vals else 0.0


def number(v) -> float:
    return float(v) if finite(v) else 0.0


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
