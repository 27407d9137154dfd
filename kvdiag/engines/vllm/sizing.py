"""The KV cache kvdiag gives a vLLM engine on a GPU when the user sizes none (no ``gpu_memory_utilization``, no
``kv_cache_memory_bytes`` in ``-a``): an explicit size, ``kv_cache_memory_bytes``, so that vLLM skips its memory
profiling and several engines can start on one GPU at once (engines that profile at once break each other's
measurement: "No available memory for the cache blocks", "Error in memory profiling").

The size holds every sequence the engine may run at once, ``max_num_seqs x max_model_len`` tokens of the model's
K+V at its own precision (a quantized dtype gets more blocks from the same bytes). vLLM still checks at start that
``gpu_memory_utilization`` of the device is free; kvdiag sets it to what the engine needs (``utilization``).
Nothing here imports vLLM or torch: the scheduler (kvdiag.run.scheduling) reads the same numbers in the parent.
"""

from __future__ import annotations

from kvdiag.models import config

SIZING_ARGS = ("gpu_memory_utilization", "kv_cache_memory_bytes")  # -a keys with which the user sizes the cache
OVERHEAD = 2 << 30  # per engine besides weights and KV cache: CUDA context, activations, workspaces, CUDA graphs
MIN_KV = 64 << 20
DEFAULT_SEQS, DEFAULT_LEN = 64, 2048  # EngineSpec's max_num_seqs, max_model_len


def token_bytes(model: str) -> int:
    """Bytes of K+V one token takes in all layers at the model's precision, from config.json (MLA: the latent and
    the rope key); 0 when the config does not say."""
    cfg = config(model, text=True)
    layers = int(cfg.get("num_hidden_layers") or 0)
    width = 2 if str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16") != "float32" else 4
    if cfg.get("kv_lora_rank"):  # MLA: one latent vector and the rope part of the key per token and layer
        return layers * (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)) * width
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // max(1, heads)))
    return 2 * layers * kv_heads * head_dim * width


def kv_cache_bytes(model: str, max_num_seqs: int = DEFAULT_SEQS, max_model_len: int = DEFAULT_LEN) -> int:
    """The explicit KV cache size for ``model``: every sequence at its longest, at least MIN_KV."""
    return max(MIN_KV, max_num_seqs * max_model_len * token_bytes(model))


def shared_need(model: str, engine_args: dict, weights: int) -> int | None:
    """GPU memory one engine takes beside others on a GPU (1.2 x weights + KV cache + OVERHEAD), or None when the
    user asked vLLM to profile (``gpu_memory_utilization`` without ``kv_cache_memory_bytes``): then it must have
    the GPU to itself."""
    if "gpu_memory_utilization" in engine_args and "kv_cache_memory_bytes" not in engine_args:
        return None
    seqs = int(engine_args.get("max_num_seqs") or DEFAULT_SEQS)
    length = int(engine_args.get("max_model_len") or DEFAULT_LEN)
    kv = int(engine_args.get("kv_cache_memory_bytes") or kv_cache_bytes(model, seqs, length))
    return footprint(weights, kv)


def footprint(weights: int, kv: int) -> int:
    """GPU memory of one engine: 1.2 x its weights, its KV cache and OVERHEAD."""
    return int(1.2 * weights) + kv + OVERHEAD


def utilization(need: int, total: int) -> float:
    """The ``gpu_memory_utilization`` that vLLM's start check (free memory >= utilization x total) asks of a device
    of ``total`` bytes for an engine that needs ``need`` bytes; with an explicit KV size vLLM uses it for nothing
    else."""
    return round(min(0.9, max(0.01, need / total)), 4) if total else 0.9
