"""vLLM's KV cache tensors and block pool, reached in-process, as kvdiag's :class:`KVBlockView`.

Path (vLLM V1, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker):
``LLM.llm_engine.engine_core`` (InprocClient) ``.engine_core`` (EngineCore) holds the
``scheduler`` (its ``kv_cache_manager.block_pool`` knows which blocks are free) and the
``model_executor.driver_worker.worker.model_runner`` whose attention layers hold their
cache tensors (``layer.kv_cache``, indexed by the scheduler's block ids).

Each attention backend packs K and V its own way: vLLM's CUDA backends (FLASH_ATTN, TRITON_ATTN,
FLASHINFER, FLEX_ATTENTION; vLLM 0.24) in a tensor of logical shape ``[num_blocks, 2, block_size,
num_kv_heads, content]`` (any physical stride order; ``content`` is head_size, plus the inline
float32 scale's padding for the per-token-head dtypes), older layouts in ``[num_blocks,
num_kv_heads, block_size, content]`` pages, the MLA backends one latent per token (``mla_view``),
vLLM's CPU kernels in an ISA-specific one; the views below give kvdiag's layout
``[num_blocks, block_size, num_kv_heads, head_size]`` without copying. A backend or
vLLM version this module does not know raises :class:`KVAccessError` with the reason.
"""

from __future__ import annotations

from kvdiag.engines.protocol import KVBlockView, KVLayer
from kvdiag.engines.vllm import hybrid
from kvdiag.engines.vllm.cpu_layout import KVAccessError, learn
from kvdiag.engines.vllm.hybrid import layer_order

# content = [K(hs) | V(hs)] per (block, head, slot): split at head_size on the last axis
SPLIT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "ROCM_AITER_FA",
                  "ROCM_AITER_UNIFIED_ATTN")
# CPU_ATTN: an ISA-specific layout inside each block, learned by cpu_layout.py
LEARNED_BACKENDS = ("CPU_ATTN",)
_LEARNED: dict = {}  # (isa, kv dtype, page shape, dtypes) -> (K, V) Affine layouts


def engine_core(llm):
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None:
        raise KVAccessError("the vLLM engine core is not in this process (set VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return core


def model_runner(llm):
    worker = getattr(getattr(engine_core(llm).model_executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        executor = type(engine_core(llm).model_executor).__name__
        raise KVAccessError(f"the model runner is not in this process (executor {executor}: tensor/pipeline "
                            "parallel workers run in their own processes)")
    return runner


def attention_layers(llm) -> list:
    """The attention modules that own a KV cache, in layer order."""
    return [m for _, m in named_attention_layers(llm)]


def named_attention_layers(llm) -> list[tuple[str, object]]:
    """``(name, module)`` of the attention layers that own a KV cache, in layer order."""
    return runner_attention_layers(model_runner(llm))


def runner_attention_layers(runner) -> list[tuple[str, object]]:
    """:func:`named_attention_layers` of one model runner (in this process or in a worker process)."""
    ctx = runner.vllm_config.compilation_config.static_forward_context
    layers = [(name, m) for name, m in ctx.items()
              if hasattr(m, "kv_cache") and hasattr(m, "impl") and getattr(m, "kv_sharing_target_layer_name", None)
              is None]
    if not layers:
        raise KVAccessError("no attention layer with a KV cache found in the forward context")
    return sorted(layers, key=lambda nm: layer_order(nm[0]))


def block_pool(llm):
    return engine_core(llm).scheduler.kv_cache_manager.block_pool


def free_blocks(pool) -> list[int]:
    """Blocks no request holds and no cached prefix may hand out again (their contents are dead)."""
    return [b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash is None]


def used_blocks(pool) -> list[int]:
    return [b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]


def _cache_tensor(layer):
    kv = layer.kv_cache
    return kv[0] if isinstance(kv, (list, tuple)) else kv


def _storage_dtype(kv_cache_dtype: str, raw):
    """The dtype K/V codes are stored in (vLLM keeps fp8 caches as uint8)."""
    import torch
    from vllm.platforms import current_platform

    if "fp8" in kv_cache_dtype and raw.dtype == torch.uint8:  # e4m3fn, or e4m3fnuz on ROCm MI300
        return torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else current_platform.fp8_dtype()
    return raw.dtype


def layer_view(layer, num_blocks: int, model_dtype) -> KVLayer:
    """One attention layer's cache as K/V views (and per-token-head scales where the backend has them)."""
    backend = layer.attn_backend.get_name()
    raw = _cache_tensor(layer)
    if getattr(layer, "kv_lora_rank", None) and raw.dim() == 3 and raw.shape[0] == num_blocks:
        return mla_view(layer, raw, backend)
    if raw.dim() not in (4, 5) or raw.shape[0] != num_blocks:
        raise KVAccessError(f"{backend}: cache shape {tuple(raw.shape)} is neither [num_blocks={num_blocks}, 2, "
                            "block_size, heads, content] nor [num_blocks, heads, block_size, content] (kernel blocks "
                            "differ from the scheduler's blocks)")
    hs = layer.head_size
    kv_dtype = getattr(layer, "kv_cache_dtype", "auto")
    storage = _storage_dtype(kv_dtype, raw)
    if backend in LEARNED_BACKENDS:
        nb, heads, bs, content = raw.shape
        key = (getattr(layer, "isa", None), kv_dtype, tuple(raw.shape[1:]), raw.dtype, model_dtype, hs)
        if key not in _LEARNED:  # the same for every layer and every call: learn it once
            _LEARNED[key] = learn(layer, raw, model_dtype, storage, hs)
        k, v = _LEARNED[key]
        return KVLayer(k.view(raw, storage, nb, bs, heads, hs), v.view(raw, storage, nb, bs, heads, hs))
    if backend not in SPLIT_BACKENDS:
        raise KVAccessError(f"kvdiag does not know how attention backend {backend} lays out its KV cache")
    raw = raw.view(storage)
    if raw.dim() == 5:  # vLLM's CUDA backends: [num_blocks, 2 (K, V), block_size, heads, content], any stride order
        if raw.shape[1] != 2:
            raise KVAccessError(f"{backend}: cache shape {tuple(raw.shape)}: axis 1 is not (K, V)")
        k, v, content = raw[:, 0, ..., :hs], raw[:, 1, ..., :hs], raw.shape[-1]
    else:  # content = [K(hs) | V(hs)] per (block, head, slot): split at head_size on the last axis
        content = raw.shape[-1]
        half = content // 2  # head_size, or head_size + the inline scale's padding (per-token-head)
        k, v = raw.transpose(1, 2)[..., :hs], raw.transpose(1, 2)[..., half:half + hs]
        content = half
    impl = layer.impl
    if content != hs and hasattr(impl, "_ensure_scale_caches"):  # per-token-head scales inline after each head
        impl._ensure_scale_caches(_cache_tensor(layer))
        return KVLayer(k, v, impl._k_scale_cache, impl._v_scale_cache)
    if content != hs:
        raise KVAccessError(f"{backend}: content {content} per head != head_size {hs} and no scale caches known")
    return KVLayer(k, v)


def mla_view(layer, raw, backend: str) -> KVLayer:
    """An MLA layer's cache (every vLLM MLA backend: ``[num_blocks, block_size, kv_lora_rank + rope]``, one latent
    per token, no heads) as one head: ``k`` the latent, ``v`` the key's rope part. fp8_ds_mla packs an fp8 latent,
    its float32 scales and a bf16 rope part into one byte row: refused."""
    rank, width = layer.kv_lora_rank, layer.head_size
    kv_dtype = getattr(layer, "kv_cache_dtype", "auto")
    if raw.shape[-1] != width:
        raise KVAccessError(f"{backend}: MLA cache ({kv_dtype}) holds {raw.shape[-1]} elements a token, not "
                            f"latent {rank} + rope {width - rank}: a packed row kvdiag does not view")
    raw = raw.view(_storage_dtype(kv_dtype, raw))
    return KVLayer(raw[:, :, None, :rank], raw[:, :, None, rank:])


def block_view(llm) -> KVBlockView:
    """The whole cache in kvdiag's layout; free/used block lists read the block pool when called.

    Every group is indexed by the pool's block ids: the attention layers' K/V with their own group's block size
    (on a hybrid model that is not ``scheduler.block_size``, the groups' LCM), a hybrid model's Mamba layers as
    :class:`KVState` tensors, and ``state_blocks`` the blocks last handed to a state group (hybrid.py says why)."""
    core = engine_core(llm)
    pool = block_pool(llm)
    cfg = core.scheduler.kv_cache_config
    view, states, state_groups = runner_view(model_runner(llm), cfg, pool.num_gpu_blocks, lambda: free_blocks(pool),
                                             lambda: used_blocks(pool))
    if states:
        owners = hybrid.track_owners(core.scheduler.kv_cache_manager.coordinator)
        view.states = states
        view.state_blocks = lambda: {b for b, g in owners.items() if g in state_groups}
    return view


def runner_view(runner, cfg, num_blocks: int, free, used) -> tuple[KVBlockView, list, set[int]]:
    """One model runner's attention caches as a view over ``num_blocks`` blocks of the scheduler's KV cache config
    ``cfg``, ``free``/``used`` giving the block pool's lists; and its state layers and their groups' ids (a hybrid:
    the caller tracks which blocks hold states)."""
    named = runner_attention_layers(runner)
    block_size = hybrid.attention_block_size(cfg, [n for n, _ in named])
    model_dtype = runner.vllm_config.model_config.dtype
    views = [layer_view(layer, num_blocks, model_dtype) for _, layer in named]
    if views[0].k.shape[1] != block_size:
        raise KVAccessError(f"cache pages hold {views[0].k.shape[1]} slots but the attention group's blocks "
                            f"{block_size} tokens")
    ctx = runner.vllm_config.compilation_config.static_forward_context
    states, state_groups = hybrid.state_layers(cfg, ctx, num_blocks, {n for n, _ in named})
    return KVBlockView(block_size, num_blocks, views, free, used), states, state_groups


def probe(llm) -> str | None:
    """None when :func:`block_view` works for this engine, else the reason it does not."""
    try:
        block_view(llm)
    except KVAccessError as e:
        return str(e)
    except (AttributeError, TypeError, RuntimeError) as e:  # a vLLM version whose internals differ
        return f"vLLM internals not as kvdiag expects ({type(e).__name__}: {e})"
    return None
