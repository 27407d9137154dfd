"""The exact binomial tail at p = 1/2 in log space, for McNemar's test on any number of discordant documents.

``2.0 ** n`` overflows at n = 1,024 and the sum of C(n, i) as Python integers is quadratic in n, so the tail is
summed in floating point relative to its largest term, C(n, k) / 2^n, whose logarithm comes from Loader's
saddle-point form ("Fast and accurate computation of binomial probabilities", 2000; R's dbinom): Stirling's
error terms and the deviance ``bd0``, accurate to about 1e-15 relative where lgamma differences lose digits
to cancellation (lgamma(n + 1) is ~1e6 at n = 1e5). Pure Python (math only); scipy is the oracle in
tests/test_stats.py.
"""

from __future__ import annotations

import math

LN2 = math.log(2.0)
_LN_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_S = (1 / 12, 1 / 360, 1 / 1260, 1 / 1680, 1 / 1188)


def stirlerr(m: int) -> float:
    """log(m!) - log(sqrt(2 pi m) (m / e)^m), the error of Stirling's formula."""
    if m <= 15:
        return math.lgamma(m + 1) - (m + 0.5) * math.log(m) + m - _LN_SQRT_2PI
    s0, s1, s2, s3, s4 = _S
    nn = float(m) * m
    if m > 500:
        return (s0 - s1 / nn) / m
    if m > 80:
        return (s0 - (s1 - s2 / nn) / nn) / m
    if m > 35:
        return (s0 - (s1 - (s2 - s3 / nn) / nn) / nn) / m
    return (s0 - (s1 - (s2 - (s3 - s4 / nn) / nn) / nn) / nn) / m


def bd0(x: float, mu: float) -> float:
    """x log(x / mu) + mu - x, without cancellation when x is near mu."""
    if abs(x - mu) < 0.1 * (x + mu):
        v = (x - mu) / (x + mu)
        s = (x - mu) * v
        ej = 2 * x * v
        v *= v
        j = 1
        while True:
            ej *= v
            s1 = s + ej / (2 * j + 1)
            if s1 == s:
                return s1
            s = s1
            j += 1
    return x * math.log(x / mu) + mu - x


def log_pmf_half(k: int, n: int) -> float:
    """log(C(n, k) / 2^n)."""
    if k < 0 or k > n:
        return -math.inf
    if k == 0 or k == n:
        return -n * LN2
    mu = n / 2
    return (stirlerr(n) - stirlerr(k) - stirlerr(n - k) - bd0(k, mu) - bd0(n - k, mu)
            + 0.5 * math.log(n / (2 * math.pi * k * (n - k))))


def log_cdf_half(k: int, n: int) -> float:
    """log P(X <= k) for X ~ Binomial(n, 1/2)."""
    if k < 0:
        return -math.inf
    if 2 * k >= n:  # the upper half: through the complement's symmetric lower tail
        if k >= n:
            return 0.0
        return math.log1p(-math.exp(log_cdf_half(n - k - 1, n)))
    # k < n/2: the terms grow up to i = k, so sum term(i) / term(k) downwards until they stop mattering
    total, ratio = 1.0, 1.0
    for i in range(k, 0, -1):
        ratio *= i / (n - i + 1)
        total += ratio
        if ratio < total * 1e-17:
            break
    return log_pmf_half(k, n) + math.log(total)


def log_two_sided_half(k: int, n: int) -> float:
    """log of the exact two-sided p-value of k successes in n trials at p = 1/2 (0.0 when the p-value is 1)."""
    if n == 0:
        return 0.0
    k = min(k, n - k)
    if 2 * k == n:
        return 0.0
    return min(0.0, LN2 + log_cdf_half(k, n))
