"""Paired statistics against independent computations (scipy, closed forms)."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from kvdiag.checks.sweep import stats


@pytest.mark.parametrize("b,c", [(0, 0), (0, 5), (3, 9), (10, 10), (1, 17), (25, 40), (0, 60)])
def test_mcnemar_exact_matches_scipy_binomtest(b, c):
    both, neither = 30, 20
    base = [1] * both + [1] * b + [0] * c + [0] * neither
    test = [1] * both + [0] * b + [1] * c + [0] * neither
    r = stats.mcnemar_exact(base, test)
    expected = 1.0 if b + c == 0 else sps.binomtest(b, b + c, 0.5).pvalue
    assert r.p_value == pytest.approx(expected, rel=1e-12, abs=1e-300)
    assert r.discordant == (b, c) and r.n == len(base)
    assert r.delta == pytest.approx(np.mean(test) - np.mean(base))
    assert r.ci_low <= r.delta <= r.ci_high


def test_mcnemar_interval_is_wald_for_paired_proportions():
    # n = 100, b = 15 (base right only), c = 5: delta = -0.10
    base = [1] * 15 + [0] * 5 + [1] * 40 + [0] * 40
    test = [0] * 15 + [1] * 5 + [1] * 40 + [0] * 40
    r = stats.mcnemar_exact(base, test)
    n, b, c = 100, 15, 5
    se = math.sqrt((b + c) / n - ((c - b) / n) ** 2) / math.sqrt(n)  # textbook form
    assert r.delta == pytest.approx(-0.10)
    assert (r.ci_low, r.ci_high) == pytest.approx((-0.10 - 1.959964 * se, -0.10 + 1.959964 * se), rel=1e-6)
    assert r.p_value < 0.05


def test_identical_samples_give_zero_delta_and_p_one():
    x = [1, 0, 1, 1, 0] * 20
    r = stats.paired_test(x, list(x))
    assert (r.test, r.delta, r.ci_low, r.ci_high, r.p_value) == ("mcnemar", 0.0, 0.0, 0.0, 1.0)
    y = [0.3, 1.7, 2.2, 0.1] * 10
    r = stats.paired_test(y, list(y))
    assert (r.test, r.delta, r.ci_low, r.ci_high, r.p_value) == ("bootstrap", 0.0, 0.0, 0.0, 1.0)


def test_bootstrap_agrees_with_the_paired_t_test_on_a_large_sample():
    rng = np.random.default_rng(0)
    base = rng.normal(10, 2, size=400)
    test = base + rng.normal(-0.15, 1.0, size=400)
    r = stats.paired_bootstrap(base, test, iters=4000)
    d = test - base
    t = sps.ttest_rel(test, base)
    half = sps.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    assert r.delta == pytest.approx(d.mean())
    assert r.ci_low == pytest.approx(d.mean() - half, abs=0.25 * half)
    assert r.ci_high == pytest.approx(d.mean() + half, abs=0.25 * half)
    assert r.p_value == pytest.approx(t.pvalue, abs=0.02)
    assert r.test == "bootstrap" and r.n == 400


def test_bootstrap_is_reproducible_and_detects_a_shift():
    rng = np.random.default_rng(1)
    base = rng.random(200)
    test = base - 0.2 + 0.05 * rng.random(200)
    a, b = stats.paired_bootstrap(base, test), stats.paired_bootstrap(base, test)
    assert a == b  # fixed seed
    assert a.p_value < 0.001 and a.ci_high < 0


def test_bootstrap_nan_gives_nan_interval():
    r = stats.paired_bootstrap([1.0, 2.0, 3.0], [1.0, float("nan"), 3.0])
    assert math.isnan(r.delta) and math.isnan(r.p_value)


def test_mean_stderr_matches_scipy_sem():
    x = [0.2, 0.9, 0.4, 1.0, 0.0, 0.7]
    assert stats.mean_stderr(x) == pytest.approx(sps.sem(x))
    assert math.isnan(stats.mean_stderr([1.0]))


def test_pair_by_doc_uses_only_common_documents_in_id_order():
    ids, a, b = stats.pair_by_doc({10: 1, 2: 0, 3: 1}, {"3": 9, 10: 0, 2: 1, 7: 1})
    assert ids == [2, 10] and a == [0, 1] and b == [1, 0]


def test_unequal_lengths_are_refused():
    with pytest.raises(ValueError):
        stats.paired_test([1, 0], [1])


def _exact_log_two_sided(k, n):
    """log(2 * sum_{i<=k} C(n, i) / 2^n) in Python integers: an oracle that neither overflows nor underflows."""
    term = total = 1
    for i in range(k):
        term = term * (n - i) // (i + 1)
        total += term
    return math.log(2 * total) - n * math.log(2)


def _discordant(b, c):
    return [1] * b + [0] * c + [1, 0] * 3, [0] * b + [1] * c + [1, 0] * 3


@pytest.mark.parametrize("b,c", [(3, 7), (10, 0), (430, 570), (480, 520), (500, 500), (0, 1024), (700, 1400),
                                 (49_000, 51_000), (49_800, 50_200), (50_000, 50_000)])
def test_mcnemar_is_exact_for_any_number_of_discordant_documents(b, c):
    r = stats.mcnemar_exact(*_discordant(b, c))  # 2.0 ** n raised OverflowError from 1,024 discordant documents
    assert r.discordant == (b, c) and r.n == b + c + 6
    assert r.p_value == pytest.approx(sps.binomtest(b, b + c, 0.5).pvalue, rel=1e-11, abs=1e-300)


@pytest.mark.parametrize("b,c", [(60_000, 40_000), (30, 99_970), (0, 1_100), (1_300, 2_000), (200, 1_400)])
def test_mcnemar_deep_tails_match_exact_integer_sums(b, c):
    k, n = min(b, c), b + c
    r = stats.mcnemar_exact(*_discordant(b, c))
    want = math.exp(_exact_log_two_sided(k, n))  # 0.0 below the smallest float
    assert r.p_value == pytest.approx(want, rel=1e-11, abs=0)
    if want > 0:
        assert math.log(r.p_value) == pytest.approx(_exact_log_two_sided(k, n), rel=1e-12)


def test_bootstrap_is_scipys_paired_bootstrap():
    """The one-sample bootstrap of the differences draws what bootstrap(paired=True) draws: the same interval."""
    rng = np.random.default_rng(3)
    base = rng.random(500)
    test = base + rng.normal(0.02, 0.2, 500)
    r = stats.paired_bootstrap(base, test)
    want = sps.bootstrap((base, test), lambda x, y, axis=-1: np.mean(y - x, axis=axis), paired=True,
                         n_resamples=stats.BOOTSTRAP_ITERS, method="percentile",
                         rng=np.random.default_rng(stats.BOOTSTRAP_SEED))
    assert (r.ci_low, r.ci_high) == pytest.approx(tuple(want.confidence_interval), rel=1e-12)
    null = want.bootstrap_distribution - (test - base).mean()
    assert r.p_value == (1 + int((np.abs(null) >= abs(r.delta)).sum())) / (stats.BOOTSTRAP_ITERS + 1)


def test_a_dtype_that_collapses_on_a_large_task_gets_a_verdict_not_a_crash():
    from kvdiag.checks.sweep import verdicts

    base = {i: 1 if i % 10 else 0 for i in range(5000)}
    paired = stats.paired_test(*verdicts.scalar_pairs(base, {i: 0 for i in range(5000)}))
    assert paired.test == "mcnemar" and paired.discordant == (4500, 0) and paired.p_value == 0.0
    assert verdicts.metric_verdict(0.9, 0.0, paired.delta, paired.p_value, True, max_drop=0.02,
                                   alpha=0.05) == "collapse"


def test_bootstrap_resamples_in_chunks_with_bounded_memory(monkeypatch):
    import tracemalloc

    rng = np.random.default_rng(2)
    n = 20_000  # one (2000, n) index array would be 320 MB, its gathered values as much again
    base = rng.random(n)
    test = base + rng.normal(0.0, 0.1, n)
    tracemalloc.start()
    try:
        r = stats.paired_bootstrap(base, test)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100e6, peak
    assert r.ci_low < r.delta < r.ci_high and 0 <= r.p_value <= 1
    base, test = base[:300], test[:300] + 0.01
    whole = stats.paired_bootstrap(base, test)
    monkeypatch.setattr(stats, "BOOTSTRAP_CHUNK", 7 * 300 + 5)  # 7 resamples at a time: same draws, same result
    assert stats.paired_bootstrap(base, test) == whole
