"""The plots of report.html: each check's own (its registry entry's ``plots``, in its folder's ``plots.py``), per
engine and model of the run."""

from __future__ import annotations

from collections import defaultdict


def plots_for(run) -> list[str]:
    from kvdiag.checks.registry import checks

    figures: list[str] = []
    present = {c.check for c in run.cases}
    for check in checks().values():  # each check's plots, from its check class
        if check.plots and check.name in present:
            for suffix, cases in _groups([c for c in run.cases if c.check == check.name]):
                figures += check.plots(cases, suffix)
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


