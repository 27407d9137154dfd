"""The smallest drop a paired comparison detects, and the documents that detect a given drop
(kvdiag/checks/sweep/power.py),
held to simulations of kvdiag's own tests (stats.mcnemar_exact, stats.paired_bootstrap): at the n the formula
gives, a drop of the size given is found in about POWER of the runs; at a quarter of that n, in far fewer. And the
verdict a user reads: `kvdiag accuracy --limit 20` cannot see a 2-point drop, so it says inconclusive (exit 0),
and fails with --strict."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from kvdiag.checks.sweep import power, stats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mcnemar_power(n: int, delta: float, psi: float, alpha: float, reps: int, seed: int) -> float:
    """Share of simulated runs in which kvdiag's McNemar test finds the drop: each document is baseline-right /
    test-wrong with probability (psi + delta) / 2, the reverse with (psi - delta) / 2."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(reps):
        u = rng.random(n)
        b, c = u < (psi + delta) / 2, (u >= (psi + delta) / 2) & (u < psi)
        base, test = (b | ~(b | c)).astype(int), (c | ~(b | c)).astype(int)  # concordant documents: both right
        r = stats.mcnemar_exact(base.tolist(), test.tolist())
        hits += r.p_value < alpha and r.delta < 0
    return hits / reps


@pytest.mark.parametrize("delta, psi", [(0.05, 0.10), (0.02, 0.02)])
def test_mcnemar_detects_the_drop_at_the_n_the_formula_gives_and_misses_it_below(delta, psi):
    n = math.ceil(power.mcnemar_n(delta, psi, 0.05))
    assert power.mcnemar_mdd(n, psi, 0.05) == pytest.approx(delta, rel=0.02)  # the two formulas agree
    at = mcnemar_power(n, delta, psi, 0.05, reps=400, seed=1)
    below = mcnemar_power(n // 4, delta, psi, 0.05, reps=400, seed=2)
    assert at >= 0.72, (n, at)  # POWER 0.8, less Monte Carlo noise (sd 0.02) and the exact test's conservatism
    assert below <= 0.45, (n // 4, below)


def test_the_paired_bootstrap_detects_the_drop_at_the_n_the_formula_gives_and_misses_it_below():
    sd, delta = 1.0, 0.5
    n = math.ceil(power.continuous_n(delta, sd, 0.05))
    assert power.continuous_mdd(n, sd, 0.05) <= delta
    rng = np.random.default_rng(3)

    def found(m):
        base = rng.normal(0, 1, m)
        r = stats.paired_bootstrap(base.tolist(), (base + rng.normal(-delta, sd, m)).tolist(), iters=400)
        return r.p_value < 0.05 and r.delta < 0

    at = sum(found(n) for _ in range(150)) / 150
    below = sum(found(n // 4) for _ in range(150)) / 150
    assert at >= 0.7 and below <= 0.45, (n, at, below)


def test_of_pairs_sizes_a_run_with_no_discordant_document_as_one_way_drops():
    """100 documents that agree everywhere: only a drop of about 8 points would be seen (6 documents flipping one way
    is the least the exact test calls significant at 0.05); a 2-point drop needs about 390 documents."""
    same = [1] * 80 + [0] * 20
    p = power.of_pairs(same, same, 0.05, 0.02, binary=True)
    assert p.psi == 0 and 0.06 < p.mdd < 0.09 and 350 < p.n_needed < 420
    assert stats.mcnemar_exact([1] * 6 + [0] * 94, [0] * 100).p_value < 0.05  # 6 one-way flips: significant
    noisy = power.of_pairs([1, 0] * 50, [0, 1] * 5 + [1, 0] * 45, 0.05, 0.02, binary=True)  # 10% discordant
    assert noisy.psi == pytest.approx(0.1) and noisy.mdd > p.mdd and noisy.n_needed > p.n_needed


@pytest.mark.slow
def test_accuracy_at_limit_20_fails_an_inconclusive_dtype_only_with_strict(tmp_path):
    """At --limit 20 fp8 is inconclusive, a pass (exit 0): the README's `kvdiag.run_check("accuracy", kv_dtypes=["auto",
    "fp8"], limit=20)`, run by tests/integration/test_docs_examples.py, holds that run to it; --strict fails it."""
    p = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-d", "fp8", "--limit", "20", "-f", "json", "-q",
                        "-o", str(tmp_path / "strict"), "--strict"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    rec = json.loads(p.stdout)
    (case,) = [c for c in rec["cases"] if c["kv_dtype"] == "fp8"]
    assert p.returncode == 1 and case["status"] == "fail" and case["findings"][0]["severity"] == "error"
    rows = [r for r in rec["analysis"]["accuracy"]["rows"] if r["kv_dtype"] == "fp8"]
    assert rows and all(r["verdict"] == "inconclusive" and r["mdd"] > 0.02 and r["n_needed"] > 20 for r in rows), rows
