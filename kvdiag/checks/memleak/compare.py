"""memleak's rule in ``kvdiag compare``: the largest growth per cycle of each measure, and the tensor MiB that
survived shutdown. Growth beyond ``mem_tolerance_mib`` (default: the case's own growth tolerance) regresses;
surviving tensors regress beyond min(tolerance, 1 MiB) (a census has no noise)."""

from __future__ import annotations

from kvdiag.checks.compare_rows import largest, number, row

RETAINED_TOL_MIB = 1.0


def rows(o, n, settings: dict) -> list[dict]:
    """memleak's rule: growth per cycle of each measure, and the tensors that survived shutdown."""
    return _memory(o, n, settings.get("mem_tolerance_mib"))


def _memory(o, n, tol) -> list[dict]:
    rows = []
    tol = tol if tol is not None else max(_growth_tol(n), _growth_tol(o), 1.0)
    og, ng = o.metrics.get("growth_mib") or {}, n.metrics.get("growth_mib") or {}
    for measure in ng:
        if measure not in og:
            continue
        a, b = largest(og[measure]), largest(ng[measure])
        rows.append(row(n, f"growth/cycle {measure} MiB", a, b, "regression" if b - a > tol else "ok",
                         tolerance=tol, unit="MiB"))
    if "survivor_mib" in n.metrics and "survivor_mib" in o.metrics:
        a, b = largest(o.metrics["survivor_mib"]), largest(n.metrics["survivor_mib"])
        lim = min(tol, RETAINED_TOL_MIB)
        rows.append(row(n, "retained tensor MiB", a, b, "regression" if b - a > lim else "ok", tolerance=lim,
                        unit="MiB"))
    return rows


def _growth_tol(rec) -> float:
    """The case's own tolerance for growth per cycle (memleak: the noisy measures'; older runs: threshold_mib)."""
    tols = rec.metrics.get("growth_tol_mib") or {}
    return number(tols.get("noisy", rec.metrics.get("threshold_mib")))
