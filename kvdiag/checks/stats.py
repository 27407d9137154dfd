"""Paired statistics for "did this kv dtype change the score on the same documents?".

Both tests compare per-document values of a test run against a baseline run on
the *same* documents (paired by doc id):

- ``mcnemar_exact``: for 0/1 metrics (acc, exact_match). Only the discordant
  documents carry information: b = baseline right / test wrong, c = the reverse.
  Under H0 each discordant document goes either way with probability 1/2, so the
  exact two-sided p-value is a binomial test of min(b, c) in b + c trials. The
  95% interval of the difference in proportions is the Wald interval for paired
  proportions (zero width when nothing is discordant).
- ``paired_bootstrap``: for any other metric. Resamples documents (with a fixed
  seed, so a run is reproducible); the interval is the percentile interval of the
  mean difference, the p-value the share of null-centred resampled means at least
  as far from 0 as the observed one, ``BOOTSTRAP_CHUNK`` indices at a time.

numpy and math only; scipy is the independent oracle in tests/test_stats.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

Z95 = 1.959963984540054
BOOTSTRAP_ITERS = 2000
BOOTSTRAP_SEED = 1234
BOOTSTRAP_CHUNK = 1 << 22  # resampled indices held at once (32 MiB of int64)


@dataclass
class Paired:
    test: str  # "mcnemar" | "bootstrap" | "none"
    n: int  # documents in both runs
    baseline: float  # mean of the baseline over those documents
    value: float  # mean of the test run over those documents
    delta: float  # value - baseline
    ci_low: float
    ci_high: float
    p_value: float
    discordant: tuple[int, int] | None = None  # mcnemar: (baseline right/test wrong, the reverse)

    def to_json(self) -> dict:
        d = asdict(self)
        d["discordant"] = list(self.discordant) if self.discordant else None
        return d


def is_binary(values) -> bool:
    return all(v in (0, 1, 0.0, 1.0, True, False) for v in values)


def mean_stderr(values) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n)), as lm_eval reports it."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1) / n)


def binom_two_sided_half(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n trials at p = 1/2, for any n (kvdiag.checks.binomial: in log
    space; 0.0 where it is below the smallest float, e.g. 60,000 vs 40,000 discordant documents)."""
    from kvdiag.checks.binomial import log_two_sided_half

    return math.exp(log_two_sided_half(k, n))


def mcnemar_exact(baseline, test) -> Paired:
    """Exact McNemar test for paired 0/1 outcomes (equal-length sequences, same order)."""
    n = len(baseline)
    _check_same_length(baseline, test)
    b = sum(1 for x, y in zip(baseline, test) if x and not y)
    c = sum(1 for x, y in zip(baseline, test) if y and not x)
    base_mean = sum(map(float, baseline)) / n if n else float("nan")
    test_mean = sum(map(float, test)) / n if n else float("nan")
    delta = (c - b) / n if n else float("nan")
    se = math.sqrt(max(b + c - (c - b) ** 2 / n, 0.0)) / n if n else float("nan")
    return Paired("mcnemar", n, base_mean, test_mean, delta, delta - Z95 * se, delta + Z95 * se,
                  binom_two_sided_half(b, b + c), (b, c))


def paired_bootstrap(baseline, test, *, iters: int = BOOTSTRAP_ITERS, seed: int = BOOTSTRAP_SEED) -> Paired:
    """Paired bootstrap of the mean difference test - baseline over documents."""
    import numpy as np

    _check_same_length(baseline, test)
    base = np.asarray(baseline, dtype=np.float64)
    diff = np.asarray(test, dtype=np.float64) - base
    n = len(diff)
    if n == 0:
        nan = float("nan")
        return Paired("bootstrap", 0, nan, nan, nan, nan, nan, nan)
    observed = float(diff.mean())
    if not np.isfinite(diff).all():
        nan = float("nan")
        return Paired("bootstrap", n, float(base.mean()), float(base.mean() + observed), observed, nan, nan, nan)
    if np.all(diff == diff[0]):  # no spread: the difference is what it is
        p = 1.0 if observed == 0 else 0.0
        return Paired("bootstrap", n, float(base.mean()), float(base.mean() + observed), observed, observed,
                      observed, p)
    rng = np.random.default_rng(seed)
    rows = max(1, BOOTSTRAP_CHUNK // n)  # resamples at a time: bounded memory for any n and iters
    means = np.concatenate([diff[rng.integers(0, n, size=(min(rows, iters - i), n))].mean(axis=1)
                            for i in range(0, iters, rows)])
    low, high = np.quantile(means, [0.025, 0.975])
    extreme = np.abs(means - observed) >= abs(observed)
    p = (1 + int(extreme.sum())) / (iters + 1)
    return Paired("bootstrap", n, float(base.mean()), float(base.mean() + observed), observed, float(low),
                  float(high), min(1.0, p))


def paired_test(baseline, test, **kw) -> Paired:
    """McNemar for 0/1 values, the paired bootstrap otherwise."""
    if is_binary(baseline) and is_binary(test):
        return mcnemar_exact(baseline, test)
    return paired_bootstrap(baseline, test, **kw)


def pair_by_doc(baseline: dict, test: dict) -> tuple[list, list, list]:
    """Values of the documents both runs scored, in doc-id order: (doc_ids, baseline values, test values)."""
    common = sorted(set(baseline) & set(test), key=_doc_key)
    return common, [baseline[d] for d in common], [test[d] for d in common]


def _doc_key(d):
    s = str(d)
    return (0, int(s), "") if s.lstrip("-").isdigit() else (1, 0, s)


def _check_same_length(a, b) -> None:
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} != {len(b)}")
