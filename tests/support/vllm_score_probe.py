"""Plain vLLM, no kvdiag: does a teacher-forced score read the KV cache?  One kv dtype per process, in kvdiag's
process layout (the engine core in this process).

``python3 tests/support/vllm_score_probe.py MODEL KV_DTYPE [key=value ...]`` -> one JSON line on stdout (``PROBE
{...}``):
for 8 recall prompts (a context of key=value pairs, then the context's pairs asked again as the continuation),
the continuation tokens' logprobs three ways:

- ``single``: context + continuation in one request with prompt logprobs, as lm_eval's vLLM backend scores
  (vLLM reads no prefix cache for a request with prompt logprobs, and computes a short prompt in one prefill);
- ``cached``: the context less its last token written first (a request of its own), then the same scoring
  request with ``skip_reading_prefix_cache=False``: the continuation is computed against the context as the
  cache holds it; ``hit`` is vLLM's ``num_cached_tokens`` of each;
- ``decode``: the logprobs of 16 greedy tokens after the context (decode reads the cache on every backend);
- ``single_steps``: each ``single`` request's tokens in each scheduler step, in the order the requests came.
  Started with ``long_prefill_token_threshold=16``, vLLM computes each prompt in 16-token chunks, each chunk
  attending the chunks before it as the cache holds them (kvdiag's scores where its prefix cache cannot serve).

``--single-only`` (anywhere after KV_DTYPE) runs the ``single`` requests alone (no ``cached``, ``hit`` or ``decode``):
for a caller that reads those alone, on an engine without a prefix cache, where the other requests leave nothing
the ``single`` ones could read.

tests/gpu/test_vllm_score.py compares two dtypes' lines: the oracle for what kvdiag's drift sees.
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
ARGS = {"enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 2048, "seed": 0,
        "enable_prefix_caching": True}


def prompts(n: int = 8) -> list[tuple[str, str]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        pairs = [(f"k{rng.randrange(1000)}", f"v{rng.randrange(1000)}") for _ in range(40 + 10 * i)]
        asked = rng.sample(pairs, 12)
        out.append((" ".join(f"{k}={v}" for k, v in pairs) + "\n", " " + " ".join(f"{k}={v}" for k, v in asked)))
    return out


def chosen(rows, ids: list[int], start: int, shift: int) -> list[float]:
    return [float(rows[start + j - shift][t].logprob) for j, t in enumerate(ids)]


class StepRecord(list):
    """(request id, tokens) of every request in every step the engine's scheduler schedules, until ``per_request``."""

    def __init__(self, llm):
        super().__init__()
        self.sched = llm.llm_engine.engine_core.engine_core.scheduler
        self.schedule = self.sched.schedule
        self.sched.schedule = self._recorded

    def _recorded(self, *args, **kwargs):
        out = self.schedule(*args, **kwargs)
        self.extend(out.num_scheduled_tokens.items())
        return out

    def per_request(self) -> list[list[int]]:
        """Each request's tokens per step, the requests in the order they were first scheduled; recording stops."""
        self.sched.schedule = self.schedule
        ids = list(dict.fromkeys(r for r, _ in self))
        return [[n for r, n in self if r == i] for i in ids]


def main(model: str, kv_dtype: str, engine: dict, single_only: bool = False) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, kv_cache_dtype=kv_dtype, **{**ARGS, **engine})
    tok = llm.get_tokenizer()
    pairs = [(tok.encode(c), tok.encode(x, add_special_tokens=False)) for c, x in prompts()]
    full = [{"prompt_token_ids": c + x} for c, x in pairs]
    score = dict(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    if single_only:
        steps = StepRecord(llm)
        single = llm.generate(full, SamplingParams(**score), use_tqdm=False)
        return {"kv_dtype": kv_dtype, "single_steps": steps.per_request(),
                "single": [chosen(s.prompt_logprobs, x, len(c), len(c) + len(x) - len(s.prompt_logprobs))
                           for (c, x), s in zip(pairs, single)],
                "context_tokens": [len(c) for c, _ in pairs]}
    llm.generate([{"prompt_token_ids": c[:-1]} for c, _ in pairs], SamplingParams(max_tokens=1, detokenize=False),
                 use_tqdm=False)
    cached = llm.generate(full, SamplingParams(**score, skip_reading_prefix_cache=False), use_tqdm=False)
    steps = StepRecord(llm)
    single = llm.generate(full, SamplingParams(**score), use_tqdm=False)  # after: its blocks would be hits above
    out_steps = steps.per_request()
    decode = llm.generate([{"prompt_token_ids": c} for c, _ in pairs],
                          SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, detokenize=False),
                          use_tqdm=False)
    out = {"kv_dtype": kv_dtype, "single": [], "cached": [], "hit": [], "decode": [], "decode_tokens": [],
           "single_steps": out_steps}
    for (c, x), s, k, d in zip(pairs, single, cached, decode):
        n = len(c) + len(x)
        out["single"].append(chosen(s.prompt_logprobs, x, len(c), n - len(s.prompt_logprobs)))
        out["cached"].append(chosen(k.prompt_logprobs, x, len(c), n - len(k.prompt_logprobs)))
        out["hit"].append(int(k.num_cached_tokens or 0))
        o = d.outputs[0]
        out["decode_tokens"].append(list(o.token_ids))
        out["decode"].append([float(lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs)])
    out["context_tokens"] = [len(c) for c, _ in pairs]
    return out


if __name__ == "__main__":
    from vllm_case_probe import value

    pairs = [a for a in sys.argv[3:] if a != "--single-only"]
    extra = {k: value(v) for k, v in (a.split("=", 1) for a in pairs)}
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2], extra, "--single-only" in sys.argv[3:])), flush=True)
    os._exit(0)
