"""accuracy's rule in ``kvdiag compare``: per task and metric, the paired per-document test (McNemar / paired
bootstrap, ``checks/sweep/stats.py``) when both sides kept their samples, else a z-test on the two stderrs. A drop
larger than ``max_drop`` that is significant at ``alpha`` (or a collapse) regresses, judged by the same rule as
`kvdiag accuracy` (``verdicts.metric_verdict``); a row the rule calls inconclusive (a drop that is not significant,
or none the paired documents could have seen: ``mdd``, ``n_needed``) says so (``inconclusive``) and is no
regression."""

from __future__ import annotations

import math

from kvdiag.checks.compare_rows import finite, row


def rows(o, n, settings: dict) -> list[dict]:
    """accuracy's rule: every task metric's change, by the paired test where both sides kept their samples."""
    return _scores(o, n, settings.get("old_samples"), settings.get("new_samples"), settings["max_drop"],
                   settings["alpha"])


def _scores(o, n, old_samples, new_samples, max_drop, alpha) -> list[dict]:
    from kvdiag.checks.sweep.stats import paired_test
    from kvdiag.checks.sweep.verdicts import metric_verdict, power_of, scalar_pairs

    rows = []
    for task, per in (n.metrics.get("scores") or {}).items():
        for metric, sc in per.items():
            osc = (o.metrics.get("scores") or {}).get(task, {}).get(metric)
            numbers = isinstance(sc.get("score"), (int, float)) and isinstance((osc or {}).get("score"), (int, float))
            if not osc or not numbers:
                continue
            pairs = paired = None
            try:
                if old_samples and new_samples:
                    pairs = scalar_pairs(old_samples[task][metric], new_samples[task][metric])
                    paired = paired_test(*pairs) if pairs else None
            except (KeyError, TypeError, ValueError):
                pairs = paired = None
            if paired is not None and paired.n > 0:
                delta, p, lo, hi, test = paired.delta, paired.p_value, paired.ci_low, paired.ci_high, paired.test
            else:
                delta, p, lo, hi = _stderr_test(osc["score"], osc.get("stderr"), sc["score"], sc.get("stderr"))
                test = "stderr"
            hib = sc.get("higher_is_better", True)
            pw = power_of(pairs, alpha, max_drop) if paired is not None and paired.n > 0 else None
            v = metric_verdict(osc["score"], sc["score"], delta, p, hib, max_drop=max_drop, alpha=alpha,
                               mdd=pw.mdd if pw else None)
            gain = delta if hib else -delta
            verdict = ("regression" if v in ("regression", "collapse") else
                       "improvement" if finite(gain) and gain > max_drop and finite(p) and p < alpha else "ok")
            rows.append(row(n, f"{task} {metric}", osc["score"], sc["score"], verdict, delta=delta, test=test,
                             p_value=p, ci_low=lo, ci_high=hi, n=paired.n if paired else sc.get("n"),
                             inconclusive=v == "inconclusive", **(pw.to_json() if pw else {})))
    return rows


def _stderr_test(a: float, se_a, b: float, se_b) -> tuple[float, float, float, float]:
    """Unpaired z-test of b - a from the two standard errors: (delta, p, 95% low, 95% high)."""
    delta = b - a
    se = math.sqrt(sum(s * s for s in (se_a, se_b) if finite(s)))
    if se == 0:
        return delta, (1.0 if delta == 0 else 0.0), delta, delta
    p = math.erfc(abs(delta) / se / math.sqrt(2))
    return delta, p, delta - 1.959963984540054 * se, delta + 1.959963984540054 * se
