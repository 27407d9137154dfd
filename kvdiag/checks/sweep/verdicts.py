"""Verdicts of the accuracy check: one row per dtype x task metric, and the case status they give.

A metric is ``ok``, ``regression`` (the drop exceeds ``max_drop`` and the paired test is
significant at ``alpha``), ``collapse`` (NaN, non-finite outputs, or below half of
the baseline while dropping more than ``max_drop``, significantly) or ``inconclusive``: a drop beyond
``max_drop`` that is not significant (its effect shown), or no drop beyond it where the run could not have seen
one (the smallest drop its documents detect with power 0.8, ``power.py``, exceeds ``max_drop``); both name the
documents that would settle it. A dtype whose drift exceeds its family's limits gets ``drift``. ``regression``,
``collapse`` and ``drift`` make the case ``fail``; ``inconclusive`` is a warning, and fails the case only with
``--strict``. KL that grows with the position (``drift.grows``) is a ``drift_grows`` warning: the case still
passes.
"""

from __future__ import annotations

import math

from kvdiag.checks.sweep import drift, power, stats

BAD = ("regression", "collapse", "drift")
ORDER = ("ok", "inconclusive", "drift", "regression", "collapse")  # a case's verdict is its worst row


def metric_verdict(base: float, score: float, delta: float, p_value: float, higher_is_better: bool, *,
                   max_drop: float, alpha: float, mdd: float | None = None) -> str:
    """``mdd``: the smallest drop the comparison detects with power 0.8 (None: not known, not judged)."""
    if not _finite(score):
        return "collapse"
    drop = -delta if higher_is_better else delta
    if not _finite(drop) or drop <= max_drop:
        return "inconclusive" if mdd is not None and not mdd <= max_drop else "ok"
    significant = _finite(p_value) and p_value < alpha
    halved = score < base / 2 if higher_is_better else score > 2 * base
    if _finite(base) and base > 0 and halved:
        return "collapse" if significant else "inconclusive"
    return "regression" if significant else "inconclusive"


def power_of(pairs: tuple[list, list] | None, alpha: float, max_drop: float) -> power.Power | None:
    """What the paired comparison of ``pairs`` (``scalar_pairs``') could have seen (``power.py``); None without
    pairs."""
    if not pairs:
        return None
    a, b = pairs
    return power.of_pairs(a, b, alpha, max_drop or None, stats.is_binary(a) and stats.is_binary(b))


def _inconclusive(task, metric, sc, bsc, delta, p, pw, paired, max_drop, alpha) -> str:
    """Why a metric's verdict is inconclusive, and the documents that would settle it."""
    n = pw.n_needed if pw else None
    settle = f"; about {n:,} documents would detect a drop of {max_drop:g}" if n else ""
    drop = -delta if sc["higher_is_better"] else delta
    if _finite(drop) and drop > max_drop:
        return (f"{task} {metric}: {sc['score']:.4g} vs baseline {bsc['score']:.4g} (Δ {delta:+.4g}) is beyond "
                f"--max-drop {max_drop:g} but not significant (p={p:.3g} ≥ {alpha:g}): not evidence of a drop"
                f"{settle}")
    docs = f"its {paired.n:,} documents" if paired else "its documents"
    return (f"{task} {metric}: could not have seen a drop of {max_drop:g}: {docs} detect a drop of "
            f"{pw.mdd if pw else float('nan'):.3g} or more with power {power.POWER:g}{settle}")


def scalar_pairs(base_vals: dict, vals: dict) -> tuple[list, list] | None:
    """The values of the documents both runs scored, in doc-id order; None for none, or non-scalar values."""
    ids, a, b = stats.pair_by_doc(base_vals, vals)
    if not ids or not all(isinstance(x, (int, float)) for x in a + b):
        return None
    return a, b



def judge_case(rec, base, base_samples: dict, samples: dict, d: dict, lim: drift.Limits, *,
               max_drop: float, alpha: float, strict: bool = False) -> list[dict]:
    """Rows for one dtype; sets the case's status, verdict, findings and comparison metrics. ``strict``: an
    inconclusive metric fails the case."""
    rows = []
    for task, per in rec.metrics["scores"].items():
        for metric, sc in per.items():
            bsc = base.metrics["scores"].get(task, {}).get(metric)
            if bsc is None:
                continue
            pairs = scalar_pairs(base_samples[task][metric], samples[task][metric])  # paired once, for both
            paired = stats.paired_test(*pairs) if pairs else None
            pw = power_of(pairs, alpha, max_drop)
            delta = paired.delta if paired else sc["score"] - bsc["score"]
            p = paired.p_value if paired else float("nan")
            # computed bit for bit as the baseline (the drift probe identical, no document changed): no drop to
            # miss, whatever the documents' number
            same = bool(d.get("identical")) and delta == 0 and not (paired and any(paired.discordant or ()))
            v = metric_verdict(bsc["score"], sc["score"], delta, p, sc["higher_is_better"],
                               max_drop=max_drop, alpha=alpha, mdd=pw.mdd if pw and not same else None)
            if not rec.metrics.get("finite", True):
                v = "collapse"
            rows.append({**_row(rec.kv_dtype, task, metric, sc, bsc["score"], delta, paired, v, d),
                         **(pw.to_json() if pw else {"mdd": None, "n_needed": None, "psi": None})})
            if v in BAD:
                rec.add("error", v, f"{task} {metric}: {sc['score']:.4g} vs baseline {bsc['score']:.4g} "
                        f"(Δ {delta:+.4g}, p={p:.3g})", task=task, metric=metric,
                        comparison=paired.to_json() if paired else None)
            elif v == "inconclusive":
                rec.add("error" if strict else "warning", "inconclusive",
                        _inconclusive(task, metric, sc, bsc, delta, p, pw, paired, max_drop, alpha), task=task,
                        metric=metric, power=pw.to_json() if pw else None,
                        comparison=paired.to_json() if paired else None)
    problems = drift.judge(d, lim)
    if lim.identical and any(r["delta"] != 0 or (r["discordant"] and any(r["discordant"])) for r in rows):
        problems.append("per-document results differ from the baseline")
    for msg in problems:
        rec.add("error", "drift", f"drift ({lim.family}): {msg}", **_drift_evidence(d))
    for kind, msg, evidence in drift.warnings(d, lim):
        rec.add("warning", kind, msg, **evidence)
    verdict = max([r["verdict"] for r in rows] + (["drift"] if problems else ["ok"]), key=ORDER.index)
    if problems:
        for r in rows:
            r["verdict"] = "drift" if r["verdict"] == "ok" else r["verdict"]
    rec.status = "fail" if verdict in BAD or (strict and verdict == "inconclusive") else "pass"
    rec.metrics.update(_drift_evidence(d), verdict=verdict, drift=d, drift_limits=lim.to_json(), comparisons=rows)
    return rows


def judge_kept(rec, d: dict, lim: drift.Limits) -> None:
    """A case that did not pass but kept its drift probe (its worker died in lm_eval): its drift's findings and
    numbers as ``judge_case`` gives a passing case's; its status and verdict stay what its failure made them."""
    for msg in drift.judge(d, lim):
        rec.add("error", "drift", f"drift ({lim.family}): {msg}", **_drift_evidence(d))
    for kind, msg, evidence in drift.warnings(d, lim):
        rec.add("warning", kind, msg, **evidence)
    rec.metrics.update(_drift_evidence(d), drift=d, drift_limits=lim.to_json())


def unchanged(rec, base, d: dict | None) -> list[tuple[str, str, dict]]:
    """Warnings (kind, line, evidence) of a dtype named as quantized that changes nothing: ``not_quantized`` when the
    storage audit of its cache finds layers at the model's precision (`kvdiag dtypes --check`'s warning, from
    ``storage_audit.storage_row``), ``identical_to_baseline`` when its drift against a baseline not named as
    quantized is bit-identical (``drift.compare``'s ``identical``). Never of the baseline, nor of ``auto`` or an
    unquantized dtype."""
    from kvdiag import dtypes
    from kvdiag.checks.sweep.storage_audit import storage_row

    if rec is base or not dtypes.named_quantized(rec.kv_dtype):
        return []
    out = []
    row = storage_row(rec)
    if row["not_quantized"]:
        out.append(("not_quantized", row["not_quantized"], {"stores": row["stores"], "layers": row["layers"]}))
    if d is not None and d.get("identical") and base is not None and not dtypes.named_quantized(base.kv_dtype):
        out.append(("identical_to_baseline", f"'{rec.kv_dtype}' is named as quantized but its drift is bit-identical "
                    f"to the baseline '{base.kv_dtype}' (KL 0, top-1 1.0, the same logprobs and greedy tokens over "
                    f"{d.get('positions')} positions): it changes nothing the model computes, as a cache stored at "
                    "the model's precision would", {"positions": d.get("positions"), "baseline": base.kv_dtype}))
    return out


def add_unchanged(rec, base, d: dict | None) -> None:
    """``unchanged``'s warnings as the case's findings."""
    for kind, msg, evidence in unchanged(rec, base, d):
        rec.add("warning", kind, msg, **evidence)


ANALYSIS_KINDS = ("regression", "collapse", "inconclusive", "drift", "drift_grows", "drift_uncached", "no_baseline",
                  "wrong", "not_quantized", "identical_to_baseline")


def position_row(rec) -> dict | None:
    """A judged case's drift by position for the reports: its dtype, ``by_position`` (drift.compare's) and, per
    section that grows, its ``drift_grows`` evidence; None when it has none."""
    d = rec.metrics.get("drift") or {}
    if not d.get("by_position"):
        return None
    return {"kv_dtype": rec.kv_dtype, "by_position": d["by_position"], "decoded": d.get("decoded"),
            "grows": {f.evidence.get("section"): f.evidence for f in rec.findings if f.kind == "drift_grows"}}


def reset(rec) -> bool:
    """Undo an earlier analysis of this record (``--resume`` analyses again); True if it has results to judge."""
    if rec.metrics.get("reason") is not None and rec.status == "fail":  # a refusal an earlier analysis judged wrong
        rec.findings, rec.status = [f for f in rec.findings if f.kind != "wrong"], "unsupported"
    if not rec.metrics.get("artifacts"):
        return False
    rec.findings = [f for f in rec.findings if f.kind not in ANALYSIS_KINDS]
    if rec.status in ("fail", "error") and not any(f.severity == "error" for f in rec.findings):
        rec.status = "pass"
    return rec.status == "pass"


def _drift_evidence(d: dict) -> dict:
    return {k: d[k] for k in ("mean_kl", "max_kl", "top1_agreement", "max_abs_dlogprob", "first_divergence")}


def _row(kv_dtype, task, metric, sc, base_score, delta, paired, verdict, d=None) -> dict:
    row = {"kv_dtype": kv_dtype, "task": task, "metric": metric, "score": sc.get("score"),
           "stderr": sc.get("stderr"), "baseline": base_score, "delta": delta,
           "ci_low": paired.ci_low if paired else None, "ci_high": paired.ci_high if paired else None,
           "p_value": paired.p_value if paired else None, "test": paired.test if paired else None,
           "n": paired.n if paired else sc.get("n"), "discordant": list(paired.discordant or ()) if paired else None,
           "verdict": verdict}
    row.update({k: (d or {}).get(k) for k in ("mean_kl", "max_kl", "top1_agreement")})
    return row


def baseline_rows(rec) -> list[dict]:
    if rec.status != "pass":
        return failed_rows(rec)
    rec.metrics["verdict"] = "baseline"
    return [_row(rec.kv_dtype, task, metric, sc, None, None, None, "baseline")
            for task, per in rec.metrics["scores"].items() for metric, sc in per.items()]


def failed_rows(rec) -> list[dict]:
    """One row for a case that has no scores to compare (crashed, timed out, errored, not run, skipped)."""
    verdict = {"timeout": "crashed", "error": "crashed", "fail": "crashed"}.get(rec.status, rec.status)
    if any(f.kind == "not_run" for f in rec.findings):
        verdict = "not run"
    first = next((f.message for f in rec.findings), "")
    row = {"kv_dtype": rec.kv_dtype, "task": "-", "metric": "-", "verdict": verdict, "status": rec.status,
           "message": first}
    if rec.metrics.get("drift"):  # measured before its worker died (judge_kept): the drift table shows it
        row.update({k: rec.metrics.get(k) for k in ("mean_kl", "max_kl", "top1_agreement")})
    return [row]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
