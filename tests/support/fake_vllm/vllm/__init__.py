"""A stand-in for vLLM's ``LLM`` and ``SamplingParams`` for the reproducer scripts' own tests (tests/unit/
test_proof.py): put on PYTHONPATH of the script's process only. Greedy output is a function of the prompt; an engine
started with ``fake_fault="..."`` changes it as the named fault says, so a test knows which comparison must fail."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from types import SimpleNamespace

STARTS = []


class SamplingParams:
    def __init__(self, max_tokens, temperature, logprobs, **extra):
        self.max_tokens, self.logprobs, self.extra = max_tokens, logprobs, extra


class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.fault = kwargs.get("fake_fault") or os.environ.get("FAKE_VLLM_FAULT")  # a patch put in the process
        self.cached = OrderedDict()  # the first blocks run since the last reset: a prompt that starts so hits
        self.room = kwargs.get("num_gpu_blocks_override")  # first blocks the cache holds (None: any number)
        self.evicted = set()  # first blocks pushed out of a full cache, least recently run first

    def reset_prefix_cache(self):
        self.cached.clear()
        self.evicted.clear()
        return True

    def generate(self, prompts, params, use_tqdm=False):
        batch = len(prompts)
        out = [SimpleNamespace(outputs=[self._one(p["prompt_token_ids"], params.max_tokens, batch)])
               for p in prompts]
        for p in prompts:  # a block of 2 tokens
            key = tuple(p["prompt_token_ids"][:2])
            self.cached[key] = None
            self.cached.move_to_end(key)
            self.evicted.discard(key)
            while self.room and len(self.cached) > self.room:
                self.evicted.add(self.cached.popitem(last=False)[0])
        return out

    def _one(self, prompt, n, batch):
        ids = [(sum(prompt) + 7 * i) % 101 for i in range(n)]
        lps = [-0.05 * (i + 1) for i in range(n)]
        if self.fault == "token" and len(prompt) % 2 == 0:  # a decided token changed at position 1
            ids[1] = (ids[1] + 1) % 101
        if self.fault == "drift":
            lps = [x - 0.2 for x in lps]
        if self.fault == "batch" and batch == 1:  # only a request alone differs
            ids[2] = (ids[2] + 1) % 101
        if self.fault == "hit" and tuple(prompt[:2]) in self.cached:  # a prefix-cache hit reads a wrong block
            ids[1] = (ids[1] + 1) % 101
        if self.fault == "evicted" and tuple(prompt[:2]) in self.evicted:  # an evicted block kept its hash: it hits
            ids[1] = (ids[1] + 1) % 101
        if self.fault == "nan":
            lps[0] = math.nan
        # the runner-up token: 1.0 below the chosen one (a decided position), 0.001 at position 3 (a near-tie)
        logprobs = [{t: SimpleNamespace(logprob=lp), t + 1000: SimpleNamespace(logprob=lp - (0.001 if i == 3 else 1.0))}
                    for i, (t, lp) in enumerate(zip(ids, lps))]
        return SimpleNamespace(token_ids=ids, logprobs=logprobs)
