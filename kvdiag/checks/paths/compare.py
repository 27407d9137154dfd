"""The paths check in ``kvdiag compare``: per case (kv dtype x path), the prompts that diverge and the largest
logprob difference from the cold path. More diverging prompts regress; a logprob difference regresses beyond the
new run's own tolerance (its floor times the factor)."""

from __future__ import annotations

from kvdiag.checks.compare_rows import number, row


def rows(o, n, settings: dict) -> list[dict]:
    om, nm = o.metrics, n.metrics
    out = []
    if "diverged_requests" in om and "diverged_requests" in nm:
        a, b = om.get("hard_divergences", 0), nm.get("hard_divergences", 0)
        out.append(row(n, "paths: diverging prompts", a, b, "regression" if b > a else "ok", tolerance=0,
                       unit="prompts"))
    if "max_dlogprob" in om and "max_dlogprob" in nm:
        a, b, tol = number(om["max_dlogprob"]), number(nm["max_dlogprob"]), number(nm.get("tolerance"))
        out.append(row(n, "paths: max |Δ logprob|", a, b, "regression" if b > max(a, tol) else "ok", tolerance=tol))
    return out
