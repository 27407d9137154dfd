"""The plots of report.html, chosen by what the run holds (filled in per check)."""

from __future__ import annotations


def plots_for(run) -> list[str]:
    figures: list[str] = []
    return figures
