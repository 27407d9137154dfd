"""The reproducer of a case failed on its drift against its baseline dtype beyond its family's limits (accuracy's
``drift`` findings, a dtypes row ``wrong`` by them), on the builtin engine (``drift_script.py``): both engines, as
kvdiag started them, score the drift probe's continuations after their contexts (the text, inline), and the script
compares the whole distributions as kvdiag does and holds them to the limits kvdiag judged by (carried as numbers).
vLLM gives no whole distribution of a prompt's tokens (its prompt logprobs stop at ``max_logprobs``): its drift has
none."""

from __future__ import annotations


def script(case, base) -> str | None:
    """The script's text, or None where this case has none (another engine, the identical family: a paths_script
    at tolerance 0 shows that one, or no baseline start recorded)."""
    from kvdiag.checks.prompts import case_prompts
    from kvdiag.checks.sweep.drift import TIE_NATS
    from kvdiag.proof.fill import filled

    lim = case.metrics.get("drift_limits")
    starts = [(r.metrics.get("replay") or {}) if r is not None else {} for r in (base, case)]
    if not lim or lim.get("identical") or any(s.get("engine") != "builtin" for s in starts):
        return None
    prompts = case_prompts(case)
    return filled("drift_script.py", {
        "title": f"{case.id}: kv_cache_dtype={case.kv_dtype!r} against {base.kv_dtype!r}, teacher-forced",
        "kvdiag_saw": "; ".join(f.message for f in case.findings if f.severity == "error"),
        "engines": {"baseline": starts[0], "dtype": starts[1]},
        "contexts": [p.context for p in prompts], "continuations": [p.continuation for p in prompts],
        "limits": {k: lim[k] for k in ("family", "mean_kl", "max_kl", "min_top1", "max_abs_dlogprob")},
        "tie_nats": TIE_NATS})
