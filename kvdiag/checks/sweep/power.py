"""What a paired comparison of two runs on the same documents could have seen: the smallest drop it detects with
power ``POWER`` at two-sided level ``alpha``, and the documents that would detect a given drop.

A drop of ``delta`` between paired per-document values has differences d_i of mean -delta:

- 0/1 metrics (the exact McNemar test): d_i is -1, 0 or +1. With a share ``psi`` of discordant documents
  (psi >= delta: each drop is a discordant document), Var(d) = psi - delta^2, and under H0 the test's variance is
  psi. Connor's sample size for McNemar (Biometrics 43, 1987): n = (z_a sqrt(psi) + z_b sqrt(psi - delta^2))^2
  / delta^2. psi is the run's own discordant share, at least ``delta``; a run with no discordant document at all
  is sized as if every drop were one-way (psi = delta), the least noise a drop can come with.
- other metrics (the paired bootstrap): n = ((z_a + z_b) sd(d) / delta)^2, sd from the run's differences.

z_a = z(1 - alpha / 2), z_b = z(POWER). Normal approximations; ``tests/unit/test_power.py`` holds them to a
simulation of kvdiag's own tests (a drop of the size given is found in at least 75% of runs of the size given, and
in far fewer at a quarter of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

POWER = 0.8


@dataclass(frozen=True)
class Power:
    mdd: float  # the smallest drop detected with POWER at the run's n
    n_needed: int | None  # documents that detect max_drop with POWER (None: no max_drop given)
    psi: float | None  # the discordant share it was sized with (0/1 metrics)

    def to_json(self) -> dict:
        return {"mdd": self.mdd, "n_needed": self.n_needed, "psi": self.psi}


def _z(alpha: float) -> tuple[float, float]:
    nd = NormalDist()
    return nd.inv_cdf(1 - alpha / 2), nd.inv_cdf(POWER)


def mcnemar_n(delta: float, psi: float, alpha: float) -> float:
    """Documents the exact McNemar test needs to see a drop of ``delta`` (a share) with POWER; ``psi`` is raised to
    ``delta`` where lower."""
    za, zb = _z(alpha)
    psi = max(psi, delta)
    return (za * math.sqrt(psi) + zb * math.sqrt(max(psi - delta * delta, 0.0))) ** 2 / (delta * delta)


def mcnemar_mdd(n: int, psi: float, alpha: float) -> float:
    """The smallest drop (a share of documents) n paired 0/1 documents detect with POWER (bisection on
    ``mcnemar_n``, which falls as the drop grows)."""
    if n <= 0:
        return math.inf
    lo, hi = 0.0, 1.0
    if mcnemar_n(hi, psi, alpha) > n:
        return math.inf  # even every document flipping one way is not enough
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mcnemar_n(mid, psi, alpha) > n else (lo, mid)
    return hi


def continuous_mdd(n: int, sd: float, alpha: float) -> float:
    za, zb = _z(alpha)
    return math.inf if n <= 0 else (za + zb) * sd / math.sqrt(n)


def continuous_n(delta: float, sd: float, alpha: float) -> float:
    za, zb = _z(alpha)
    return ((za + zb) * sd / delta) ** 2


def of_pairs(baseline: list, test: list, alpha: float, max_drop: float | None, binary: bool) -> Power:
    """The power of one paired comparison (the documents both runs scored, in the same order)."""
    n = len(baseline)
    if binary:
        psi = sum(1 for a, b in zip(baseline, test) if bool(a) != bool(b)) / n if n else 0.0
        need = mcnemar_n(max_drop, psi, alpha) if max_drop else None
        return Power(mcnemar_mdd(n, psi, alpha), None if need is None else math.ceil(need), psi)
    d = [float(b) - float(a) for a, b in zip(baseline, test)]
    mean = sum(d) / n if n else 0.0
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else math.inf
    need = continuous_n(max_drop, sd, alpha) if max_drop and math.isfinite(sd) else None
    return Power(continuous_mdd(n, sd, alpha), None if need is None else max(2, math.ceil(need)), None)
