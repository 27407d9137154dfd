"""The dtypes check's options (each default written once: the CLI, the config and the worker read
them from here)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.checks.sweep.drift import drift_limit


@dataclass
class DtypesParams:
    max_kl: float | None = drift_limit("max_kl")
    min_top1: float | None = drift_limit("min_top1")
