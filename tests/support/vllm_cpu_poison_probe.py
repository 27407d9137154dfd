"""Plain vLLM, no kvdiag: does vLLM's attention read KV slots that no request wrote? Greedy outputs of three
prompts; then every KV cache tensor (every block free: no request is running) filled with VALUE (nan, or max: bf16's
largest finite number); the prefix cache reset; the same prompts again, which write their own slots before reading
them. The oracle of kvdiag's poison verdict on vLLM (tests/integration/test_vllm_cpu_poison.py).

    python3 tests/support/vllm_cpu_poison_probe.py MODEL nan|max     -> ``PROBE {...}`` on stdout
"""

import json
import math
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
PROMPTS = ["kmbt=0932 abcd=1234 ; kmbt=", "The capital of France is", "1, 2, 3, 4,"]


def main(model: str, value: str) -> dict:
    import torch
    from probes import kv_cache_bytes
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enforce_eager=True, kv_cache_memory_bytes=kv_cache_bytes(), max_model_len=512, seed=0,
              dtype="bfloat16")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)

    def run():
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return [(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]

    ref = run()
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    caches = runner.kv_caches if isinstance(runner.kv_caches, list) else list(runner.kv_caches.values())
    fill = float("nan") if value == "nan" else torch.finfo(torch.bfloat16).max
    for t in caches:
        (t if t.dtype == torch.bfloat16 else t.view(torch.bfloat16)).fill_(fill)
    llm.reset_prefix_cache()
    out = run()
    return {"value": value, "caches": len(caches), "shape": list(caches[0].shape), "dtype": str(caches[0].dtype),
            "same_tokens": [a[0] == b[0] for a, b in zip(ref, out)],
            "nonfinite_logprobs": sum(1 for _, lps in out for x in lps if not math.isfinite(x))}


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
    os._exit(0)
