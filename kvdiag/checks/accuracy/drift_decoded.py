"""Decoded drift: KL by position along a continuation each kv dtype decodes itself (``--drift-decoded N``).

The drift by position of ``drift.py`` scores a fixed text, the same for every dtype: teacher-forced, as a prefill
computes it. Here each dtype greedily decodes ``N`` tokens from every drift prompt (``collect``, in its own worker,
on its own engine), and that continuation is scored teacher-forced twice in the same worker: by the dtype's engine
and by an engine of the baseline dtype (``rescore``: a second engine on the same weights where the engine can share
them, the builtin one; else a fresh one after the dtype's engine is shut down). Both sides are teacher-forced scores
of the same tokens, so a dtype computed as the baseline is exactly 0, and the KL per position (``compare``,
bucketed as ``drift_position``) follows the path the dtype itself took, where its own earlier tokens and their
cache are what later positions read. The first divergence is the first position where the dtype decoded a token
the baseline, at that point of the dtype's own text, ranks more than ``drift.TIE_NATS`` below its top: where the
generation left what the baseline would write.
"""

from __future__ import annotations

from kvdiag.checks.sweep import drift, drift_position

MAX_TOKENS = 1024  # --drift-decoded's bound: a decoded continuation per drift prompt


# ------------------------------------------------------------------ worker side


def collect(engine, prompts, tokens: int) -> dict:
    """The dtype's greedy continuation of each prompt's generation text, and its own teacher-forced scores of it."""
    gens = engine.generate([p.generate for p in prompts], tokens, greedy=True)
    out = {"tokens": [list(map(int, g.token_ids)) for g in gens]}
    out.update(_scored(engine, prompts, out["tokens"]))
    return out


def _scored(engine, prompts, tokens) -> dict:
    """``chosen`` and ``top`` (the top ``drift.LONG_TOP_K``) of ``tokens`` teacher-forced after each prompt."""
    # a continuation cut to nothing (an immediate end of sequence) has no positions to score
    live = [i for i, t in enumerate(tokens) if t]
    scored = engine.score([prompts[i].generate for i in live], [tokens[i] for i in live], top_k=drift.LONG_TOP_K)
    chosen, top = [[] for _ in tokens], [[] for _ in tokens]
    for i, s in zip(live, scored):
        chosen[i] = list(map(float, s.logprobs))
        top[i] = [{int(t): float(v) for t, v in pos.items()} for pos in s.top_logprobs]
    return {"chosen": chosen, "top": top}


def rescore(case, engine, data: dict, prompts) -> None:
    """The baseline dtype's teacher-forced scores of the decoded continuations (``data["decoded"]["base"]``).
    ``engine`` is shut down first where it cannot share its weights (one engine at a time: vLLM on a GPU)."""
    from dataclasses import replace

    from kvdiag.checks.common import start_engine
    from kvdiag.engines.protocol import SharesWeights

    shares = isinstance(engine, SharesWeights)
    if not shares:
        engine.shutdown()
    base = start_engine(replace(case, kv_dtype=case.params["baseline"]), weights_from=engine if shares else None)
    try:
        data["decoded"]["base"] = _scored(base, prompts, data["decoded"]["tokens"])
    finally:
        base.shutdown()


# ------------------------------------------------------------------ parent side


def add(d: dict, test: dict) -> None:
    """``compare``'s result into ``d`` (``drift.compare``'s): ``d["decoded"]`` and the position buckets
    ``d["by_position"]["decoded"]``; nothing when ``test`` has no rescored decoded continuation."""
    section = test.get("decoded") or {}
    if "base" not in section:
        return
    summary, kls, agree = compare(section)
    d["decoded"] = summary
    d.setdefault("by_position", {})["decoded"] = drift_position.buckets(kls, agree)


def compare(section: dict) -> tuple[dict, list[list[float]], list[list[bool]]]:
    """(summary, KL per position, top-1 agreement per position) of a decoded section: KL(baseline || dtype) and
    top-1 agreement of the two teacher-forced scorings (``drift._topk_pos``), the first divergence."""
    base, test = section["base"], section
    kls, agree = [], []
    for b, t in zip(base["top"], test["top"]):
        k, a = drift._topk_pos(b, t)
        kls.append(k)
        agree.append(a)
    flat = [x for row in kls for x in row]
    ok = [x for row in agree for x in row]
    first = first_divergence(base)
    return {"tokens": max((len(t) for t in section["tokens"]), default=0), "positions": len(flat),
            "mean_kl": drift._nan_mean(flat), "max_kl": drift._nan_max(flat),
            "top1_agreement": sum(ok) / len(ok) if ok else float("nan"), "first_divergence": first,
            "diverged": sum(_diverges(c, t) is not None for c, t in zip(base["chosen"], base["top"]))}, kls, agree


def first_divergence(base: dict) -> dict | None:
    """The earliest position (0-based, over every prompt; the first prompt on a tie) where the decoded token is
    more than ``drift.TIE_NATS`` below the baseline's top there; None where none is."""
    found = [(j, i) for i, (c, t) in enumerate(zip(base["chosen"], base["top"])) if (j := _diverges(c, t)) is not None]
    if not found:
        return None
    j, i = min(found)
    return {"prompt": i, "position": j}


def _diverges(chosen: list[float], top: list[dict[int, float]]) -> int | None:
    for j, (lp, row) in enumerate(zip(chosen, top)):
        if row and lp < max(row.values()) - drift.TIE_NATS:
            return j
    return None
