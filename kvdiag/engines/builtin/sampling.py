"""Requests of ``generate`` and the logits -> tokens/logprobs steps of generate and score.

Greedy is argmax of the float32 logits (ties -> lowest id). Seeded sampling draws at
temperature 1 from the float32 softmax on CPU with a ``torch.Generator`` per request
seeded from the seed (as vLLM's per-request seed), so results do not depend on batching
or device. Logprobs are ``log_softmax`` of the float32 logits.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvdiag.engines.protocol import Completion, Scored


class Request:
    """One prompt of ``generate``: tokens so far, block table, and what was generated."""

    def __init__(self, prompt: list[int], max_tokens: int, eos: set[int], stop: tuple[str, ...],
                 decode: Callable[[list[int]], str], seed: int | None):
        self.prompt, self.tokens, self.max_tokens = prompt, list(prompt), max_tokens
        self.eos, self.stop, self.decode = eos, stop, decode
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict[int, float]] = []
        self.table: list[int] = []
        self.reserved = 0  # blocks reserved for prompt + max_tokens
        self.finish_reason: str | None = None
        self.text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        self.tokens.append(token)
        self.out.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top.append(top)
        if token in self.eos:
            self.finish_reason = "stop"
        elif self.stop:
            text = self.decode(self.out)
            hits = [i for i in (text.find(s) for s in self.stop if s) if i >= 0]
            if hits:
                self.text, self.finish_reason = text[:min(hits)], "stop"
        if self.finish_reason is None and len(self.out) >= self.max_tokens:
            self.finish_reason = "length"

    def completion(self, logprobs: int) -> Completion:
        return Completion(prompt_token_ids=list(self.prompt), token_ids=list(self.out), logprobs=list(self.logprobs),
                          top_logprobs=list(self.top) if logprobs > 0 else None,
                          text=self.decode(self.out) if self.text is None else self.text,
                          finish_reason=self.finish_reason or "length")


def _top(lp: torch.Tensor, k: int) -> list[dict[int, float]]:
    values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


@torch.inference_mode()
def sample(batch: list[Request], logits: torch.Tensor, logprobs: int) -> None:
    """Pick one token per request from its logits row [len(batch), vocab] and append it."""
    lf = logits.float()
    lp = torch.log_softmax(lf, dim=-1)
    tokens = lf.argmax(dim=-1).tolist()
    if any(r.generator is not None for r in batch):
        probs = torch.softmax(lf, dim=-1).cpu()
        for i, r in enumerate(batch):
            if r.generator is not None:
                tokens[i] = int(torch.multinomial(probs[i], 1, generator=r.generator))
    rows = torch.arange(len(batch), device=lp.device)
    chosen = lp[rows, torch.tensor(tokens, device=lp.device)].tolist()
    tops = _top(lp, logprobs) if logprobs > 0 else [None] * len(batch)
    for r, t, c, top in zip(batch, tokens, chosen, tops):
        r.append(t, c, top)


@torch.inference_mode()
def score_rows(logits: torch.Tensor, continuation: list[int], top_k: int) -> Scored:
    """Teacher-forced scores: row i of ``logits`` predicts ``continuation[i]``."""
    lf = logits.float()
    lp = torch.log_softmax(lf, dim=-1)
    target = torch.tensor(continuation, device=lp.device)
    chosen = lp.gather(1, target[:, None]).squeeze(1).tolist()
    return Scored(logprobs=chosen, is_greedy=bool((lf.argmax(dim=-1) == target).all()),
                  top_logprobs=_top(lp, top_k) if top_k > 0 else None,
                  distributions=lp.cpu() if top_k == -1 else None)
