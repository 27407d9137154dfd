"""Faults in the paths by which vLLM's KV cache reaches attention other than one cold prefill (bug class S5): a
prefix-cache hit, a block evicted from a full prefix cache, preemption and a chunked prefill; ``paths`` must catch
each on its own path while the cold path stays clean. (Speculative decoding's: ``spec.py``; the sliding window's:
``window.py``; CPU offload's: ``offload.py``.)

All four patch the scheduler's bookkeeping (the KV-cache manager, its block pool and the scheduler of vLLM's V1
engine core), not a kernel: what the model runner is told is computed no longer matches what its blocks hold, so
attention reads K/V that no prefill of that request wrote. None names a vLLM fix: each re-introduces a bug class, not
a known regression.
"""

from __future__ import annotations

from kvdiag.engines.vllm.faults.patching import CodePoint, fire, wrap

GET_COMPUTED = CodePoint("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks")
PREEMPT = CodePoint("vllm.v1.core.sched.scheduler", "Scheduler._preempt_request")
AFTER_SCHEDULE = CodePoint("vllm.v1.core.sched.scheduler", "Scheduler._update_after_schedule")
EVICT = CodePoint("vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block")
HIT_SHORT = "prefix_hit_block_dropped"
PREEMPT_KEEPS = "preempt_keeps_computed_tokens"
CHUNK_SKIPS = "chunk_boundary_token_skipped"
EVICTED_KEEPS = "evicted_block_keeps_hash"


def prefix_hit_block_dropped(kv_cache_dtype: str | None = None) -> list[str]:
    """S5, a prefix-cache hit counted one block longer than the blocks it hands out.

    Code point: ``KVCacheManager.get_computed_blocks(request)`` (``vllm/v1/core/kv_cache_manager.py``), which returns
    the cached blocks of the request's longest prefix hit and the number of tokens they hold (vLLM 0.32 adds a third
    item, the shared-prefix boundary, passed through here). Relied on: that method, its result's first two items, and
    ``KVCacheBlocks.blocks`` (a tuple of per-group block lists), all as old as V1's prefix cache. Versions: vLLM 0.24
    (by those names; its source was not read here), 0.32. The fault: on a hit of at least one block, the last hit
    block is dropped from every group while the token count stays. The scheduler then allocates a fresh block for
    those positions and never computes them (they count as computed): attention reads a block nobody wrote for that
    request. The class of an off-by-one between a hit's length and its blocks. Fires on every hit it shortens: never
    on a cold run (the cache is reset before each) nor after ``reset_prefix_cache``; also where vLLM serves a
    preempted request's recompute from its own cached blocks (prefix caching on, vLLM's default).

    Intended check: ``paths``, ``prefix-hit`` and ``prefix-partial`` (finding ``divergence`` or
    ``logprob_drift``); the cold paths and ``prefix-reset`` pass.

    Outside kvdiag: ``apply(["prefix_hit_block_dropped"])`` before ``vllm.LLM(..., enable_prefix_caching=True)``.
    """
    def make(original):
        def get_computed_blocks(self, request, *args, **kwargs):
            out = original(self, request, *args, **kwargs)
            blocks, hit = out[0], out[1]
            groups = getattr(blocks, "blocks", ())
            if not hit or not groups or not all(len(g) for g in groups):
                return out
            fire(HIT_SHORT)
            shorter = type(blocks)(tuple(list(g)[:-1] for g in groups))
            return (shorter, hit, *out[2:])
        return get_computed_blocks
    wrap(GET_COMPUTED, HIT_SHORT, make)
    return [str(GET_COMPUTED)]


def preempt_keeps_computed_tokens(kv_cache_dtype: str | None = None) -> list[str]:
    """S5, a preempted request resumed without its recompute: its blocks are freed, its computed count kept.

    Code point: ``Scheduler._preempt_request(request, timestamp, ...)`` (``vllm/v1/core/sched/scheduler.py``), where
    the V1 scheduler frees a preempted request's blocks, sets ``request.num_computed_tokens = 0`` (the recompute) and
    puts it back in the waiting queue. Relied on: that method and ``Request.num_computed_tokens``. Versions: vLLM
    0.24 (by those names; its source was not read here), 0.32. The fault: after vLLM's own preemption the request's
    ``num_computed_tokens`` is put back as it was (fires once per preemption). Resumed, the request skips the
    prefix-cache lookup (a waiting request with computed tokens is taken as holding its KV), gets fresh blocks for
    all its tokens and computes only the last: its decode reads K/V nobody wrote for it. The class of a recompute
    lost on preemption, as the builtin engine's ``preempt_keeps_freed_blocks``. Fires only where vLLM preempts: a
    pool too small for every request at once.

    Intended check: ``paths``, ``preemption`` (finding ``divergence`` or ``logprob_drift``; were vLLM to raise on
    the inconsistent request instead, the case's crash).

    Outside kvdiag: ``apply(["preempt_keeps_computed_tokens"])`` before ``vllm.LLM(..., num_gpu_blocks_override=N)``
    with N too few blocks for the batch.
    """
    def make(original):
        def _preempt_request(self, request, *args, **kwargs):
            kept = getattr(request, "num_computed_tokens", 0)
            result = original(self, request, *args, **kwargs)
            if kept:
                fire(PREEMPT_KEEPS)
                request.num_computed_tokens = kept
            return result
        return _preempt_request
    wrap(PREEMPT, PREEMPT_KEEPS, make)
    return [str(PREEMPT)]


def chunk_boundary_token_skipped(kv_cache_dtype: str | None = None) -> list[str]:
    """S5, a prefill chunk's end counted one token too far: the first token of the next chunk is never computed.

    Code point: ``Scheduler._update_after_schedule(scheduler_output)`` (``vllm/v1/core/sched/scheduler.py``), where
    the V1 scheduler advances each scheduled request's ``num_computed_tokens`` by its scheduled tokens once the step
    is scheduled (so that the next step can schedule the rest of a chunked prefill at once). Relied on: that method,
    ``scheduler_output.num_scheduled_tokens`` (request id -> tokens), ``Scheduler.requests`` and ``Request``'s
    ``num_computed_tokens`` and ``num_prompt_tokens``. Versions: vLLM 0.24 (source read: the same method, advancing
    ``num_computed_tokens`` the same way), 0.32. The fault: after vLLM's own advance, a request still mid-prefill
    (``num_computed_tokens + 1 < num_prompt_tokens``) is advanced one token more. The next chunk starts a token
    later: that prompt token is never fed to the model, its K/V slot is never written, and every later token's
    attention reads whatever the slot held (another request's K/V, or the pool's initial zeros). The class of an
    off-by-one between a chunk's end and the next chunk's start. Fires once per chunk boundary: never on a prefill
    that fits one step (a cold run), nor on the chunk that finishes a prompt (at least one prompt token is always
    left to compute, so the request still samples its first token; advancing it to the end would leave it nothing
    to schedule).

    Intended check: ``paths``, ``chunked-prefill`` (finding ``divergence`` or ``logprob_drift``); the other paths
    run whole prefills and pass. The path's engine leaves room past the longest request (``engines.vllm.paths.ROOM``):
    at the request's own length, vLLM's scheduler stops scheduling a request whose count ran ahead to the end, and
    the case hung to its timeout (docs/vllm-gpu-results.md).

    Outside kvdiag: ``apply(["chunk_boundary_token_skipped"])`` before ``vllm.LLM(..., enable_chunked_prefill=True,
    max_num_batched_tokens=N)`` with N below the prompts' length.
    """
    def make(original):
        def _update_after_schedule(self, scheduler_output, *args, **kwargs):
            result = original(self, scheduler_output, *args, **kwargs)
            for req_id in scheduler_output.num_scheduled_tokens:
                request = self.requests.get(req_id)
                if request is not None and request.num_computed_tokens + 1 < request.num_prompt_tokens:
                    fire(CHUNK_SKIPS)
                    request.num_computed_tokens += 1
            return result
        return _update_after_schedule
    wrap(AFTER_SCHEDULE, CHUNK_SKIPS, make)
    return [str(AFTER_SCHEDULE)]


def evicted_block_keeps_hash(kv_cache_dtype: str | None = None) -> list[str]:
    """S5, a cached block evicted to be handed out again stays in the prefix cache's lookup under its old hash.

    Code point: ``BlockPool._maybe_evict_cached_block(block)`` (``vllm/v1/core/block_pool.py``), which
    ``get_new_blocks`` calls for each block it takes off the free queue: it drops the block's hash from
    ``cached_block_hash_to_block`` and resets the block's own (``block.reset_hash()``), and says whether the block
    was cached. Relied on: that method, ``KVCacheBlock.block_hash`` and ``reset_hash()``, and (vLLM 0.32) the pool's
    ``cached_block_hashes_by_block``, read only where it exists. Versions: vLLM 0.32 (source read); 0.24 by those
    names (its source was not read here). The fault (vLLM #44237's shape: a block's hash not reset on reuse): the
    block's own hash is reset, as vLLM does, but the lookup keeps the old hash pointing at it. A later prompt with the
    evicted prefix "hits" the block and reads the K/V its new owner wrote. Fires on every eviction of a cached block:
    only a pool under pressure evicts (never in the check's other prefix paths, whose pool holds everything).

    Intended check: ``paths``, ``prefix-evicted`` (finding ``divergence`` or ``logprob_drift``); the other paths'
    pools evict nothing.

    Outside kvdiag: ``apply(["evicted_block_keeps_hash"])`` before ``vllm.LLM(..., enable_prefix_caching=True,
    num_gpu_blocks_override=N)`` with N small enough that new prompts evict cached ones.
    """
    def make(original):
        def _maybe_evict_cached_block(self, block, *args, **kwargs):
            if getattr(block, "block_hash", None) is None:
                return original(self, block, *args, **kwargs)
            fire(EVICTED_KEEPS)
            by_block = getattr(self, "cached_block_hashes_by_block", None)
            if isinstance(by_block, dict):
                by_block.pop(block.block_id, None)
            block.reset_hash()  # the block is fresh to its new owner; the lookup still finds it by the old hash
            return True
        return _maybe_evict_cached_block
    wrap(EVICT, EVICTED_KEEPS, make)
    return [str(EVICT)]
