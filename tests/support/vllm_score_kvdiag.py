"""kvdiag's side of tests/support/vllm_score_probe.py: its vLLM engine's ``score`` of the probe's prompts, in a
process of
its own, and how vLLM's scheduler computed each scoring request.

``python3 tests/support/vllm_score_kvdiag.py MODEL KV_DTYPE [prefix_caching=true|false]`` -> ``PROBE {...}``: ``scores``
(the continuation tokens' logprobs), ``from_cache`` (``Scored.context_from_cache``), ``steps`` (each request's
tokens in each scheduler step, in the order the requests came: those scored in chunks last, as the probe's
``single_steps``) and ``context_tokens``.
"""

from __future__ import annotations

import json
import os
import sys

from vllm_score_probe import StepRecord, prompts

from kvdiag.engines.base import EngineSpec
from kvdiag.engines.vllm.engine import VllmEngine


def main(model: str, kv_dtype: str, prefix_caching: bool | None) -> dict:
    engine = VllmEngine()
    engine.start(EngineSpec(model=model, kv_cache_dtype=kv_dtype, max_model_len=2048, prefix_caching=prefix_caching,
                            engine_args={"enforce_eager": True, "gpu_memory_utilization": 0.2}))
    tok = engine.tokenizer
    pairs = [(tok.encode(c), tok.encode(x, add_special_tokens=False)) for c, x in prompts()]
    steps = StepRecord(engine.llm)
    scored = engine.score([c for c, _ in pairs], [x for _, x in pairs])
    return {"scores": [s.logprobs for s in scored], "from_cache": [s.context_from_cache for s in scored],
            "steps": steps.per_request(), "context_tokens": [len(c) for c, _ in pairs]}


if __name__ == "__main__":
    pc = dict(a.split("=", 1) for a in sys.argv[3:]).get("prefix_caching")
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2], None if pc is None else pc == "true")), flush=True)
    os._exit(0)
