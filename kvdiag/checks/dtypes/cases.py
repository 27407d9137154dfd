"""The dtypes matrix's cases: every dtype the engine names, against 'auto'."""

from __future__ import annotations

from kvdiag.checks.cases import Target, resolve_sweep, sweep_cases


def cases(target: Target, p) -> tuple:
    """(cases, analyze) of the support matrix (``kvdiag dtypes --check``) with DtypesParams ``p``: every dtype
    against 'auto'."""
    from kvdiag.checks.dtypes.verdict import analyze

    sweep = resolve_sweep(target, "auto", all_names=True)
    cases = sweep_cases("dtypes", sweep, {}, target.isolate)
    return cases, lambda run: analyze(run, max_kl=p.max_kl, min_top1=p.min_top1)
