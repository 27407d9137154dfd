"""Paired statistics for "did this kv dtype change the score on the same documents?".

Both tests compare per-document values of a test run against a baseline run on
the *same* documents (paired by doc id):

- ``mcnemar_exact``: for 0/1 metrics (acc, exact_match). Only the discordant
  documents carry information: b = baseline right / test wrong, c = the reverse.
  Under H0 each discordant document goes either way with probability 1/2, so the
  exact two-sided p-value is ``scipy.stats.binomtest(b, b + c, 0.5)``. The
  95% interval of the difference in proportions is the Wald interval for paired
  proportions (zero width when nothing is discordant).
- ``paired_bootstrap``: for any other metric. ``scipy.stats.bootstrap`` resamples
  documents (with a fixed seed, so a run is reproducible); the interval is the
  percentile interval of the mean difference, the p-value the share of null-centred
  resampled means at least as far from 0 as the observed one, ``BOOTSTRAP_CHUNK``
  indices at a time.

scipy is imported inside the functions (the CLI's start does not pay for it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

Z95 = 1.959963984540054
BOOTSTRAP_ITERS = 2000
BOOTSTRAP_SEED = 1234
BOOTSTRAP_CHUNK = 1 << 21  # resampled indices held at once (16 MiB of int64; scipy holds ~3x that at its peak)


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
    """Exact two-sided p-value of k successes in n trials at p = 1/2 (scipy's binomtest; 1.0 for n = 0; 0.0 below
    the smallest float, e.g. 60,000 vs 40,000 discordant documents). At most ~10 ms up to 10^6 trials."""
    if n == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(k, n, 0.5).pvalue)


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
    # The paired resampling of documents, as the one-sample bootstrap of their differences: the same draws and the
    # same interval as bootstrap((baseline, test), paired=True) (tests/unit/test_stats.py), in half the time and memory
    # (docs/development.md, "Figures behind constants").
    from scipy.stats import bootstrap

    res = bootstrap((diff,), np.mean, n_resamples=iters, batch=max(1, BOOTSTRAP_CHUNK // n), method="percentile",
                    confidence_level=0.95, rng=np.random.default_rng(seed))
    means = res.bootstrap_distribution
    low, high = res.confidence_interval
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
