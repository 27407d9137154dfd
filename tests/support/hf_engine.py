"""Test-only Engine over a Hugging Face transformers model: no paged cache, one plain forward per request.

It implements the kvdiag Engine protocol just far enough for the lm_eval adapter and
the drift code, so they can be tested against lm_eval's own HFLM on the same weights.
``calls`` records every score/generate call (batching is part of what is tested).
"""

from __future__ import annotations

import torch

from kvdiag.engines.base import Capabilities, Completion, Scored
from kvdiag.engines.protocol import EndOfText


class HFEngine(EndOfText):
    name = "hf-test"

    def __init__(self, path, full_logits: bool = True):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos_token_id = self.tok.eos_token_id
        self.calls: list[tuple[str, int]] = []
        self._caps = Capabilities(kv_dtypes=("auto",), full_logits=full_logits, max_logprobs=20)

    @property
    def capabilities(self):
        return self._caps

    def encode(self, text):
        return self.tok.encode(text)

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def _ids(self, x):
        return list(x) if not isinstance(x, str) else self.encode(x)

    @torch.no_grad()
    def _logprobs(self, ids):
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)

    def score(self, contexts, continuations, *, top_k=0):
        self.calls.append(("score", len(contexts)))
        out = []
        for ctx, cont in zip(contexts, continuations):
            ctx = self._ids(ctx)
            cont = self._ids(cont) if not isinstance(cont, str) else self.tok.encode(cont, add_special_tokens=False)
            lp = self._logprobs(ctx + cont)[len(ctx) - 1:len(ctx) + len(cont) - 1]
            chosen = lp[torch.arange(len(cont)), torch.tensor(cont)]
            top = None
            if top_k > 0:
                v, i = lp.topk(top_k, -1)
                top = [dict(zip(a.tolist(), b.tolist())) for a, b in zip(i, v)]
            out.append(Scored(chosen.tolist(), bool((lp.argmax(-1) == torch.tensor(cont)).all()), top,
                              lp.clone() if top_k == -1 else None))
        return out

    def generate(self, prompts, max_tokens, *, greedy=True, logprobs=0, seed=None, stop=()):
        self.calls.append(("generate", len(prompts)))
        out = []
        for p in prompts:
            ids = self._ids(p)
            gen, lps = [], []
            for _ in range(max_tokens):
                lp = self._logprobs(ids + gen)[-1]
                t = int(lp.argmax())
                gen.append(t)
                lps.append(float(lp[t]))
                if t == self.eos_token_id or any(s and s in self.decode(gen) for s in stop):
                    break
            out.append(Completion(ids, gen, lps, text=self.decode(gen)))
        return out

    def shutdown(self):
        pass
