"""Paired statistics against independent computations (scipy, closed forms)."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from kvdiag.checks import stats


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
