"""The dtypes check's plots in report.html: drift by position against 'auto'."""

from __future__ import annotations

from kvdiag.checks.sweep.drift_position import position_plots


def plots(cases, suffix: str = "") -> list[str]:
    return position_plots([c for c in cases if c.check == "dtypes"], suffix)
