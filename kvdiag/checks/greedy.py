"""What the KV-state checks (wake-cycle, poison) share: their prompts, the ``unsupported``
record of an engine that cannot be tested, and the token-for-token comparison of two
greedy runs of the same prompts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def prompt_texts(model: str, limit: int | None = None) -> list[str]:
    """The generation prompts of the fixed prompt set for ``model`` (kvdiag.checks.prompts); the first ``limit``."""
    from kvdiag.checks.prompts import prompt_set

    return [p.generate for p in prompt_set(model, limit=limit)]


LOGPROB_TOL = 1e-4  # |Δ logprob| allowed when tokens are identical (same kernels, same inputs)


def unsupported(case, reason: str):
    """The record of a case the engine cannot run (a kv dtype it refuses, no sleep mode, no KV access), in its
    words: status ``unsupported``, an info finding ``unsupported``."""
    reason = reason.strip().splitlines()[0] if reason.strip() else "unsupported"
    rec = case.result("unsupported", metrics={"reason": reason})
    rec.add("info", "unsupported", reason)
    return rec


@dataclass
class GreedyDiff:
    requests: int = 0
    tokens: int = 0  # generated tokens compared (the reference's)
    diverged: int = 0  # requests whose tokens differ anywhere
    max_dlogprob: float = 0.0  # max |Δ logprob| over the positions before each request's first divergence
    nonfinite: int = 0  # NaN/Inf logprobs in the new run
    first: dict = field(default_factory=dict)  # {request, position, expected, got} of the first divergence
    first_nonfinite: dict = field(default_factory=dict)  # {request, position, logprob}

    @property
    def identical(self) -> bool:
        return self.diverged == 0

    def exceeds(self, tol: float) -> bool:
        return not math.isfinite(self.max_dlogprob) or self.max_dlogprob > tol

    def metrics(self) -> dict:
        return {"requests": self.requests, "tokens": self.tokens, "identical": self.identical,
                "diverged_requests": self.diverged, "max_dlogprob": self.max_dlogprob,
                "nonfinite_logprobs": self.nonfinite, "first_difference": self.first or None}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ref, out) -> GreedyDiff:
    """Compare completions ``out`` with the reference ``ref`` (same prompts, same order)."""
    if len(ref) != len(out):
        raise ValueError(f"{len(out)} completions for {len(ref)} reference completions")
    d = GreedyDiff(requests=len(ref))
    for r, (a, b) in enumerate(zip(ref, out)):
        d.tokens += len(a.token_ids)
        pos = first_divergence(a.token_ids, b.token_ids)
        if pos is not None:
            d.diverged += 1
            if not d.first:
                d.first = {"request": r, "position": pos, "expected": _at(a.token_ids, pos),
                           "got": _at(b.token_ids, pos)}
        same = len(b.token_ids) if pos is None else pos
        for x, y in zip(a.logprobs[:same], b.logprobs[:same]):
            d.max_dlogprob = _nanmax(d.max_dlogprob, abs(x - y))
        for i, lp in enumerate(b.logprobs):
            if not math.isfinite(lp):
                d.nonfinite += 1
                if not d.first_nonfinite:
                    d.first_nonfinite = {"request": r, "position": i, "logprob": lp}
    return d


def _nanmax(a: float, b: float) -> float:
    """max that keeps a NaN once seen."""
    return a if math.isnan(a) else b if math.isnan(b) else max(a, b)


def _at(ids: list[int], i: int) -> int | None:
    return ids[i] if i < len(ids) else None


def describe(diff: GreedyDiff, prompts, decode=None) -> str:
    """One line naming the request and position that first differed, and the tokens there."""
    f = diff.first
    if not f:
        return "outputs identical"
    p = prompts[f["request"]]
    label = repr(p[:40] + ("…" if len(p) > 40 else "")) if isinstance(p, str) else f"{len(p)} prompt tokens"

    def tok(t):
        if t is None:
            return "end of output"
        return f"{t} ({decode([t])!r})" if decode else str(t)

    return (f"request {f['request']} ({label}) first differs at generated position {f['position']}: "
            f"{tok(f['got'])} instead of {tok(f['expected'])}; {diff.diverged}/{diff.requests} requests differ")
