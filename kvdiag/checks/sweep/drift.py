"""Token-level drift of a kv dtype against a baseline, over the fixed prompt set.

Worker side: ``collect`` scores the prompts teacher-forced (the whole next-token
distribution when the engine gives it, else its top-k), scores the long fixed continuation
of each generation prompt the same way (``Prompt.long``, its first ``LONG_TOKENS`` tokens)
and generates greedily; ``save``/``load`` put that in a case artifact. Parent side:
``compare`` measures a case against the baseline case and ``judge`` holds it to its dtype
family's limits; ``grows`` says where KL grows with the position (``drift_position.py``).

Metrics: mean/max KL(baseline || dtype) per position, top-1 agreement, max |Δ logprob|
of the teacher-forced token, first (prompt, position) where greedy generations differ; and
by position (``by_position``): KL and top-1 per position bucket (1-16, 17-32, 33-64, ...) of
the prompts' continuations and of the long continuation. The totals, which the limits judge,
are over the prompts' continuations only (as they were calibrated).
Top-1 agreement counts a position as agreeing when the dtype's top token is one the
baseline ranks within ``TIE_NATS`` of its own top: a flip between near-tied tokens is
what any rounding does on a flat distribution, not a change of the model's answer.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

from kvdiag.checks.check import option
from kvdiag.checks.sweep import drift_position

TOP_K = 64  # top-k kept when the engine gives no full distribution (or it would be too big to store)
MAX_FULL_BYTES = 256 << 20  # full distributions of the prompts above this are reduced to top-k before saving
GREEDY_TOKENS = 16
LONG_TOKENS = 128  # tokens of each long continuation scored (buckets 1-16 ... 65-128)
# The long continuations keep only the top 16 of each position (in the artifact as two arrays, ~200 KB for 12
# prompts): on the shipped model their KL per bucket is within 0.1% of the full distributions'.
LONG_TOP_K = 16
TIE_NATS = 0.1  # baseline logprobs this close to its top count as tied for top-1 agreement


# ------------------------------------------------------------------ worker side


def collect(engine, prompts, *, greedy_tokens: int = GREEDY_TOKENS, long_tokens: int = LONG_TOKENS) -> dict:
    """Teacher-forced scores, long continuations' scores (``long``) and greedy tokens of ``prompts``
    (kvdiag.checks.prompts.Prompt)."""
    out = _scores(engine, [p.context for p in prompts], [p.continuation for p in prompts], MAX_FULL_BYTES, TOP_K)
    long = [p for p in prompts if p.long]
    if long and long_tokens > 0:
        out["long"] = _scores(engine, [p.generate for p in long],
                              [first_tokens(engine, p.long, long_tokens) for p in long], 0, LONG_TOP_K)
    gens = engine.generate([p.generate for p in prompts], greedy_tokens, greedy=True)
    out["greedy"] = [list(map(int, g.token_ids)) for g in gens]
    out["greedy_prompt_ids"] = [list(map(int, g.prompt_token_ids)) for g in gens]  # what a reproducer replays
    out["greedy_logprobs"] = [list(map(float, g.logprobs)) for g in gens]
    return out


def _scores(engine, contexts, continuations, max_full_bytes: int, keep: int) -> dict:
    """``over`` (full or top-k), ``chosen`` (each continuation token's logprob) and ``dists`` (full) or ``top``
    (the top ``keep`` of each position; full distributions above ``max_full_bytes`` are reduced to that)."""
    import torch

    full = bool(engine.capabilities.full_logits)
    top_k = -1 if full else min(keep, engine.capabilities.max_logprobs or keep)
    scored = engine.score(contexts, continuations, top_k=top_k)
    out = {"over": "full" if full else "top-k", "chosen": [list(map(float, s.logprobs)) for s in scored],
           "from_cache": [s.context_from_cache for s in scored]}
    if full:
        dists = [torch.as_tensor(s.distributions).float().cpu().numpy() for s in scored]
        if sum(d.size for d in dists) * 4 > max_full_bytes:
            out["over"], out["top"] = "top-k", [_topk_dicts(d, keep) for d in dists]
        else:
            out["dists"] = dists
    else:
        out["top"] = [[{int(t): float(v) for t, v in pos.items()} for pos in s.top_logprobs] for s in scored]
    return out


def first_tokens(engine, text: str, n: int) -> list[int]:
    """The first ``n`` token ids of ``text`` as a continuation (without what the tokenizer puts before any text,
    a BOS)."""
    ids, lead = list(engine.encode(text)), list(engine.encode(""))
    if lead and ids[:len(lead)] == lead:
        ids = ids[len(lead):]
    return ids[:n]


def _topk_dicts(dist, k: int) -> list[dict[int, float]]:
    """Each row's k largest entries as {index: value} (``dist``: [positions, vocab], numpy or a CPU tensor)."""
    import numpy as np

    dist = np.asarray(dist)
    idx = np.argsort(-dist, axis=-1, kind="stable")[:, :min(k, dist.shape[-1])]
    return [dict(zip(i.tolist(), row[i].tolist())) for i, row in zip(idx, dist)]


def finite(data: dict) -> bool:
    """No NaN/inf in what the engine returned for the prompts (logprobs may be -inf only in distributions)."""
    import numpy as np

    sections = [data] + ([data["long"]] if "long" in data else [])
    vals = [v for row in data["greedy_logprobs"] + [r for sec in sections for r in sec["chosen"]] for v in row]
    return all(math.isfinite(v) for v in vals) and not any(bool(np.isnan(d).any()) for d in data.get("dists", []))


def save(data: dict, path) -> None:
    """numpy's .npz (no pickle): the distributions as float32 arrays (``distI``), the long continuations' tokens'
    logprobs and top-k token ids and logprobs as arrays (``longchI``, ``longidI``, ``longlpI``), the decoded
    continuations' tokens (``dectokI``) and their two scorings the same way (``dec...``: the dtype's, ``decb...``: the
    baseline's; drift_decoded.py), everything else as one JSON string. The parent that compares the dtypes then needs
    numpy only, not torch (~1.8 s of import)."""
    import numpy as np

    meta = {k: v for k, v in data.items() if k not in ("dists", "decoded")}
    arrays = {f"dist{i}": np.asarray(d, dtype=np.float32) for i, d in enumerate(data.get("dists", []))}
    if "long" in data:
        meta["long"] = {"over": "top-k"}
        arrays.update(_section_arrays("long", _long_top(data["long"])))
    if "decoded" in data:
        dec = data["decoded"]
        meta["decoded"] = {"base": "base" in dec}
        arrays.update({f"dectok{i}": np.asarray(t, dtype=np.int32) for i, t in enumerate(dec["tokens"])})
        arrays.update(_section_arrays("dec", dec))
        if "base" in dec:
            arrays.update(_section_arrays("decb", dec["base"]))
    with open(path, "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), **arrays)


def _section_arrays(prefix: str, section: dict) -> dict:
    """A scored section's per-prompt arrays: the tokens' logprobs (``PREFIXchI``), top-k ids and logprobs."""
    import numpy as np

    out = {}
    for i, (chosen, rows) in enumerate(zip(section["chosen"], section["top"])):
        out[f"{prefix}ch{i}"] = np.asarray(chosen, dtype=np.float32)
        out[f"{prefix}id{i}"], out[f"{prefix}lp{i}"] = _pack(rows)
    return out


def _long_top(section: dict) -> dict:
    """A long-continuation section as top-k (``LONG_TOP_K`` of full distributions)."""
    if "top" in section:
        return section
    return {**section, "over": "top-k", "top": [_topk_dicts(d, LONG_TOP_K) for d in section["dists"]]}


def _pack(rows: list[dict[int, float]]):
    """Top-k dicts of a prompt's positions as two arrays [positions, k]: token ids (-1 pads a shorter row) and
    their logprobs (float32, as the full distributions are stored)."""
    import numpy as np

    k = max((len(r) for r in rows), default=0)
    ids, lps = np.full((len(rows), k), -1, dtype=np.int32), np.zeros((len(rows), k), dtype=np.float32)
    for j, r in enumerate(rows):
        ids[j, :len(r)], lps[j, :len(r)] = list(r), list(r.values())
    return ids, lps


def _unpack(ids, lps) -> list[dict[int, float]]:
    return [{int(t): float(v) for t, v in zip(i, lp) if t >= 0} for i, lp in zip(ids.tolist(), lps.tolist())]


def load(path) -> dict:
    import numpy as np

    if str(path).endswith(".pt"):  # an artifact of an earlier kvdiag (torch.save of the same dict), e.g. on --resume
        import torch

        return torch.load(path, weights_only=True)
    prefixes = [f"{s}{kind}" for s in ("long", "dec", "decb") for kind in ("ch", "id", "lp")]
    with np.load(path, allow_pickle=False) as z:
        data = json.loads(str(z["meta"]))
        arrays = {prefix: [a for _, a in sorted((int(k[len(prefix):]), z[k]) for k in z.files
                                                if k.startswith(prefix) and k[len(prefix):].isdigit())]
                  for prefix in ("dist", "dectok", *prefixes)}
    _restore(data, arrays["dist"])
    if "long" in data:
        data["long"].update(_section(arrays, "long"))
    if "decoded" in data:
        has_base = data["decoded"].pop("base")
        data["decoded"] = {"tokens": [a.tolist() for a in arrays["dectok"]], **_section(arrays, "dec")}
        if has_base:
            data["decoded"]["base"] = _section(arrays, "decb")
    return data


def _section(arrays: dict, prefix: str) -> dict:
    return {"chosen": [a.tolist() for a in arrays[f"{prefix}ch"]],
            "top": [_unpack(i, lp) for i, lp in zip(arrays[f"{prefix}id"], arrays[f"{prefix}lp"])]}


def _restore(data: dict, dists: list) -> None:
    if "top" in data:  # JSON object keys are strings
        data["top"] = [[{int(t): v for t, v in pos.items()} for pos in rows] for rows in data["top"]]
    if dists or data.get("over") == "full":
        data["dists"] = dists


# ------------------------------------------------------------------ parent side


def compare(base: dict, test: dict) -> dict:
    """Drift of ``test`` against ``base`` (both from ``collect`` over the same prompts)."""
    over, kls, agree = _per_position(base, test)
    flat_kl = [x for row in kls for x in row]
    flat_agree = [x for row in agree for x in row]
    dlp = [abs(x - y) for bx, tx in zip(base["chosen"], test["chosen"]) for x, y in zip(bx, tx)]
    first = first_divergence(base["greedy"], test["greedy"])
    identical = (dlp and max(dlp) == 0 and first is None and _same_dists(base, test, over))
    by_position = {"prompts": drift_position.buckets(kls, agree)}
    if "long" in base and "long" in test:
        _, long_kls, long_agree = _per_position(base["long"], test["long"])
        by_position["long"] = drift_position.buckets(long_kls, long_agree)
    return {
        "drift_over": over,
        "positions": len(flat_kl),
        "mean_kl": _nan_mean(flat_kl),
        "max_kl": _nan_max(flat_kl),
        "top1_agreement": sum(flat_agree) / len(flat_agree) if flat_agree else float("nan"),
        "max_abs_dlogprob": _nan_max(dlp),
        "first_divergence": first,
        "identical": bool(identical),
        "by_position": by_position,
        "context_from_cache": from_cache(test),
    }


def from_cache(data: dict) -> float | None:
    """The share of prompts whose continuation was scored against its context read back from the KV cache
    (``Scored.context_from_cache`` > 0); None when the engine does not say (an artifact of an earlier kvdiag)."""
    said = [n for n in data.get("from_cache") or [] if n is not None]
    return sum(n > 0 for n in said) / len(said) if said else None


def _per_position(base: dict, test: dict) -> tuple[str, list[list[float]], list[list[bool]]]:
    """(over, KL per position, top-1 agreement per position), one list per prompt, of a scored section."""
    over = "full" if base["over"] == test["over"] == "full" else "top-k"
    kls, agree = [], []
    for i in range(len(base["chosen"])):
        k, a = (_full_pos(base["dists"][i], test["dists"][i]) if over == "full"
                else _topk_pos(_tops(base, i), _tops(test, i)))
        kls.append(k)
        agree.append(a)
    return over, kls, agree


def _tops(data: dict, i: int) -> list[dict[int, float]]:
    return data["top"][i] if "top" in data else _topk_dicts(data["dists"][i], TOP_K)


def _full_pos(p_log, q_log) -> tuple[list[float], list[bool]]:
    import numpy as np

    p_log, q_log = np.asarray(p_log, dtype=np.float64), np.asarray(q_log, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        terms = np.where(p_log > -math.inf, np.exp(p_log) * (p_log - q_log), 0.0)
        kl = np.maximum(terms.sum(-1), 0.0)  # NaN stays NaN
        picked = np.take_along_axis(p_log, q_log.argmax(-1)[:, None], -1)[:, 0]
        return kl.tolist(), (picked >= p_log.max(-1) - TIE_NATS).tolist()


def _topk_pos(base_rows, test_rows) -> tuple[list[float], list[bool]]:
    """KL over the baseline's top-k plus one tail bucket; a token missing from the test's top-k
    gets the test's smallest listed logprob (an upper bound on its probability)."""
    kls, agree = [], []
    for b, t in zip(base_rows, test_rows):
        floor = min(t.values()) if t else -math.inf
        kl = sum(math.exp(lp) * (lp - t.get(tok, floor)) for tok, lp in b.items())
        p_tail = max(0.0, 1.0 - sum(math.exp(v) for v in b.values()))
        q_tail = max(1e-12, 1.0 - sum(math.exp(t.get(tok, floor)) for tok in b))
        if p_tail > 0:
            kl += p_tail * math.log(p_tail / q_tail)
        kls.append(max(kl, 0.0) if kl == kl else kl)
        top = max(b.values()) if b else -math.inf
        agree.append(bool(t) and b.get(max(t, key=t.get), -math.inf) >= top - TIE_NATS)
    return kls, agree


def _same_dists(base: dict, test: dict, over: str) -> bool:
    if over == "full":
        import numpy as np

        return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(base["dists"], test["dists"]))
    return all(_tops(base, i) == _tops(test, i) for i in range(len(base["chosen"])))


def first_divergence(base: list[list[int]], test: list[list[int]]) -> dict | None:
    """The first prompt (in order) whose greedy tokens differ, and the first differing position."""
    for i, (a, b) in enumerate(zip(base, test)):
        for j in range(max(len(a), len(b))):
            if j >= len(a) or j >= len(b) or a[j] != b[j]:
                return {"prompt": i, "position": j}
    return None


def _nan_mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _nan_max(xs) -> float:
    if any(x != x for x in xs):
        return float("nan")
    return max(xs) if xs else float("nan")


# ------------------------------------------------------------------ limits


@dataclass(frozen=True)
class Limits:
    family: str
    mean_kl: float
    max_kl: float
    min_top1: float
    max_abs_dlogprob: float
    identical: bool = False  # bit-identical required (mean/max KL 0, same greedy tokens)

    def to_json(self) -> dict:
        return asdict(self)


# Calibrated on the clean builtin engine with the shipped model: KL limits leave >= 5x headroom over the worst
# drift seen, |Δ logprob| >= 3x (the figures: docs/DESIGN.md, "Drift limits").
FAMILY_LIMITS = {
    "identical": Limits("identical", 0.0, 0.0, 1.0, 0.0, identical=True),
    # the identical family when the engine compiles its model (vLLM's defaults): each kv dtype is compiled and
    # autotuned apart (vLLM hashes cache_dtype into the compile cache; Inductor max-autotune picks kernels by
    # timing), so two equal caches can differ in the last bits. Both limits sit ~8x above that noise and 5x below
    # the S1 fault (bfloat16 run as fp8); the figures: docs/DESIGN.md, "Drift limits".
    "recompiled": Limits("recompiled", 1e-4, 2e-3, 0.99, 0.5),
    "unquantized": Limits("unquantized", 2e-3, 0.1, 0.95, 1.0),
    "fp8_e4m3": Limits("fp8_e4m3", 0.02, 1.0, 0.9, 4.0),
    "fp8_e5m2": Limits("fp8_e5m2", 0.06, 4.0, 0.8, 5.0),
    "int8_per_token_head": Limits("int8_per_token_head", 2e-3, 0.1, 0.95, 1.0),
    "fp8_per_token_head": Limits("fp8_per_token_head", 0.02, 1.0, 0.9, 4.0),
    "quantized": Limits("quantized", 0.06, 4.0, 0.8, 5.0),
}


def family(kv_dtype: str, model_dtype: str | None) -> str:
    """Which limits apply: ``identical`` for auto and for an unquantized dtype equal to the model's, else the dtype
    registry's family for the name (kvdiag/dtypes.py); a name no registry knows gets ``quantized``."""
    from kvdiag import dtypes

    d = dtypes.get(kv_dtype)
    if d is not None and not d.quantized and d.storage == model_dtype:
        return "identical"
    return dtypes.drift_family(kv_dtype) or "quantized"


def wrongly_refused(rec, base) -> str | None:
    """Why a refused case is wrong (bug S1), else None: an explicit unquantized dtype equal to the model's dtype is
    what the baseline ``base`` stores; the engine refusing it while the baseline started is no refusal."""
    from kvdiag.results import NOT_RUN_STATUSES

    if rec.status not in NOT_RUN_STATUSES or base is None or rec is base or base.status != "pass" or \
            family(rec.kv_dtype, base.metrics.get("model_dtype")) != "identical":
        return None
    reason = rec.metrics.get("reason") or next((f.message for f in rec.findings), "")
    return (f"explicit '{rec.kv_dtype}' is the model's dtype (what '{base.kv_dtype}' stores, and that started) but "
            f"the engine refused it: {reason}")


def compiled_pair(rec, base) -> bool:
    """Whether a case or its baseline ran a compiled model (their records' ``compiled``)."""
    return bool(rec.metrics.get("compiled") or base.metrics.get("compiled"))


def limits_for(kv_dtype: str, model_dtype: str | None, *, compiled: bool = False, max_kl: float | None = None,
               min_top1: float | None = None) -> Limits:
    """The limits a case is judged by; ``compiled``: the case or its baseline ran a compiled model (the engine's
    ``compiled``), where the identical family becomes ``recompiled``. ``max_kl``/``min_top1`` tighten or loosen
    the others, never these two."""
    lim = FAMILY_LIMITS[family(kv_dtype, model_dtype)]
    if lim.identical:
        return FAMILY_LIMITS["recompiled"] if compiled else lim
    if max_kl is not None:
        lim = replace(lim, mean_kl=max_kl, max_kl=max(lim.max_kl, max_kl * 25))
    if min_top1 is not None:
        lim = replace(lim, min_top1=min_top1)
    return lim


def judge(metrics: dict, lim: Limits) -> list[str]:
    """What is out of bounds, one line each (empty when within the limits)."""
    if lim.identical:
        if metrics["identical"]:
            return []
        where = metrics["first_divergence"]
        return [f"not bit-identical to the baseline (mean KL {metrics['mean_kl']:.3g}, max |Δ logprob| "
                f"{metrics['max_abs_dlogprob']:.3g}" + (f", greedy tokens differ at prompt {where['prompt']} "
                                                        f"position {where['position']}" if where else "") + ")"]
    bad = []
    for key, limit, worse in (("mean_kl", lim.mean_kl, lambda v, t: v > t), ("max_kl", lim.max_kl, lambda v, t: v > t),
                              ("top1_agreement", lim.min_top1, lambda v, t: v < t),
                              ("max_abs_dlogprob", lim.max_abs_dlogprob, lambda v, t: v > t)):
        v = metrics[key]
        if v != v or worse(v, limit):
            bad.append(f"{key} {v:.4g} beyond the {lim.family} limit {limit:g}")
    return bad


def grows(d: dict, lim: Limits) -> list[tuple[str, dict]]:
    """Where KL grows with the position (``drift_position.grows`` against the dtype's mean-KL limit): per scored
    section that grows, a line and its evidence (the section, the first and last judged buckets, their mean KL,
    the ratio, the limit); empty when none grows."""
    out = []
    for section, rows in (d.get("by_position") or {}).items():
        g = drift_position.grows(rows, lim.mean_kl)
        if g is not None:
            ratio = f"{g['ratio']:.1f}x" if g["ratio"] is not None else "from 0"
            out.append((f"KL grows with the position along the {SECTION_WORDS.get(section, section)}: mean KL "
                        f"{g['first_kl']:.3g} at positions {g['first']}, {g['last_kl']:.3g} at {g['last']} ({ratio}; "
                        f"above the {lim.family} limit {lim.mean_kl:g})", {"section": section, **g,
                                                                           "limit": lim.mean_kl}))
    return out


def warnings(d: dict, lim: Limits) -> list[tuple[str, str, dict]]:
    """The drift's warnings (kind, line, evidence): ``drift_grows`` (``grows``) and ``drift_uncached``: a quantized
    dtype whose teacher-forced scores mostly did not read their context back from the KV cache (vLLM: contexts
    shorter than one scoring chunk, or a scheduler kvdiag cannot reach; engines/vllm/scoring.py), so that a backend
    attending a first prefill on unquantized K/V would show little or no drift."""
    out = [("drift_grows", msg, evidence) for msg, evidence in grows(d, lim)]
    share = d.get("context_from_cache")
    if share is not None and share < MIN_FROM_CACHE and lim.family not in UNQUANTIZED_FAMILIES:
        out.append(("drift_uncached", f"drift read the context back from the KV cache for {share:.0%} of the "
                    "prompts: the rest were scored in one prefill, which some backends attend on the unquantized "
                    "K/V, so drift may not show this cache (contexts too short to leave a part in the cache, or an "
                    "engine that cannot score in chunks)",
                    {"context_from_cache": share}))
    return out


MIN_FROM_CACHE = 0.5  # a drift whose prompts read their context back from the cache less often than this is warned
UNQUANTIZED_FAMILIES = ("identical", "recompiled", "unquantized")
SECTION_WORDS = {"prompts": "prompts' continuations", "long": f"long continuations ({LONG_TOKENS} tokens)",
                 "decoded": "decoded continuations"}


DRIFT = ".drift.npz"


def drift_limit(name: str):
    """The drift limits accuracy and dtypes --check both take."""
    if name == "max_kl":
        return option(None, "--max-kl", min=0, help="Mean KL(baseline||dtype) allowed per position for every dtype "
                      "that need not be bit-identical (default: per dtype family, see docs).")
    return option(None, "--min-top1", min=0, max=1, help="Top-1 agreement with the baseline required (default: per "
                  "dtype family).")
