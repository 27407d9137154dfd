"""How the builtin engine takes each path of the ``paths`` check (``kvdiag/checks/paths/catalogue.py``): its prefix
cache (``EngineSpec.prefix_caching``; for ``prefix-evicted`` in a pool of the prompts' size), preemption by
recompute (``-a preemption=1`` and a tight pool), chunked prefill (``-a enable_chunked_prefill=1``), its KV connector
(``-a kv_connector_dir``: files a second engine loads), and its decode CUDA graphs against none. It has no piecewise
graphs, no speculative decoding, no offload, no tensor parallelism and never runs past a sliding window: those are
unsupported, said before any engine starts."""

from __future__ import annotations

from kvdiag.engines.traits import PathConfig

NONE = {
    "cudagraph-piecewise": "the builtin engine captures whole decode steps only (cudagraph-full), never pieces",
    "spec-ngram": "the builtin engine has no speculative decoding",
    "offload": "the builtin engine has no KV offload",
    "sliding-window": "the builtin engine caps max_model_len at a model's sliding window: it never decodes past one",
    "tensor-parallel": "the builtin engine runs on one device: it has no tensor parallelism",
}
NO_GRAPHS = "the builtin engine captures CUDA graphs on a CUDA device only"


def path_config(path: str, need: dict) -> PathConfig | str:
    if path in NONE:
        return NONE[path]
    if path == "cold":
        return PathConfig()
    if path == "prefix-evicted":
        return PathConfig(spec={"prefix_caching": True, "num_blocks": need["evict_blocks"],
                                "max_model_len": need["evict_model_len"]})
    if path.startswith("prefix-"):
        return PathConfig(spec={"prefix_caching": True})
    if path == "preemption":
        return PathConfig(spec={"num_blocks": need["tight_blocks"]},
                          args={"preemption": 1})
    if path == "chunked-prefill":
        return PathConfig(args={"enable_chunked_prefill": 1, "max_num_batched_tokens": need["chunk_tokens"]})
    if path == "kv-connector":  # two engines of these arguments: one saves each prompt's blocks, one loads them
        return PathConfig(args={"kv_connector_dir": need["connector_dir"]})
    if path in ("cudagraph-full", "cold-nographs"):
        if need["device"] != "cuda":
            return NO_GRAPHS
        return PathConfig(args={"cuda_graphs": int(path == "cudagraph-full")})
    return f"the builtin engine has no path '{path}'"
