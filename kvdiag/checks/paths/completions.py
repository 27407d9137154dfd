"""Greedy completions as a case record keeps them (``metrics.completions``): a path case that ran in an engine of its
own is judged against its reference case in the parent (``verdict.analyze``), from these. Token ids, each token's
logprob and the top two logprobs per position (all ``floor.margin`` needs): a few KiB per case. ``layouts``: the
floor's runs in other batch layouts (``engine_runs.floor_runs``), kept the same way."""

from __future__ import annotations

from kvdiag.engines.protocol import Completion


def to_json(completions) -> list[dict]:
    return [{"token_ids": list(c.token_ids), "logprobs": list(c.logprobs),
             "top": [sorted(t.values(), reverse=True)[:2] for t in c.top_logprobs or []]} for c in completions]


def from_json(rows: list[dict]) -> list[Completion]:
    return [Completion(prompt_token_ids=[], token_ids=r["token_ids"], logprobs=r["logprobs"],
                       top_logprobs=[dict(enumerate(t)) for t in r["top"]] or None) for r in rows]


def layouts_to_json(layouts: dict) -> dict:
    out = {}
    if "all_but_one" in layouts:
        out["all_but_one"] = to_json(layouts["all_but_one"])
    if "recomputed" in layouts:
        cuts, parts = layouts["recomputed"]
        out["recomputed"] = {"cuts": list(cuts), "completions": to_json(parts)}
    return out
