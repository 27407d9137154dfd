"""What vLLM's worker processes hold, asked inside them (tensor parallelism: one worker process per GPU).

kvdiag's process holds the engine core (its scheduler and block pool); the model runners, their KV cache tensors and
the model's weights live in the workers. ``collective_rpc`` (vLLM's ``LLM.collective_rpc``) sends a function to every
worker and returns each one's answer; vLLM calls it with the worker (a ``WorkerWrapperBase``, which passes attribute
reads to the worker), so the functions below read what a worker holds and answer with plain numbers, never tensors.
They run in the workers: kvdiag must be importable there (vLLM's workers start from kvdiag's process).
"""

from __future__ import annotations

import os

RPC_TIMEOUT_S = 120.0  # a worker that does not answer by then is stuck: the check fails rather than hangs


def _tensors(x):
    """The tensors of a runner's ``kv_caches`` (a list per layer; a Mamba layer's is a list of state tensors)."""
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
    elif hasattr(x, "untyped_storage"):
        yield x


def state(worker) -> dict:
    """In one worker: its pid and GPU, its KV cache storages ``(device, data_ptr, nbytes)`` (each counted once), the
    bytes of the model's parameters, and torch's allocated and reserved bytes on its device."""
    import torch

    from kvdiag.gpus import current_gpu

    runner = worker.model_runner
    kv = {}
    for t in _tensors(getattr(runner, "kv_caches", None) or []):
        s = t.untyped_storage()
        if s.nbytes():
            kv[(str(t.device), s.data_ptr())] = s.nbytes()
    model = runner.get_model()
    weights = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters() if p.numel()}
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"pid": os.getpid(), "rank": getattr(worker, "rank", None), "gpu": current_gpu() if cuda else None,
            "kv": [(dev, ptr, n) for (dev, ptr), n in sorted(kv.items())], "weight_bytes": sum(weights.values()),
            "allocated": torch.cuda.memory_allocated() if cuda else None,
            "reserved": torch.cuda.memory_reserved() if cuda else None}


def empty_cache(worker) -> int | None:
    """In one worker: hand the caching allocator's unused blocks back to the driver (as kvdiag does in its own
    process before it measures a sleep: vLLM's sleep empties the cache and its wake never refills it); torch's
    reserved bytes after."""
    import gc

    import torch

    gc.collect()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def on_view(worker, fn, cfg, num_blocks: int, free: list[int], used: list[int], owners: dict | None, args: tuple):
    """In one worker: ``fn(view, *args)`` on its model runner's KV cache (its shard of the heads), the block pool's
    ``free`` and ``used`` lists as the engine core had them when it asked; for a hybrid, its state layers too, with
    ``owners`` (``{block: group}`` of the blocks the engine core handed out since it began tracking them,
    ``hybrid.track_owners``) saying which blocks hold states."""
    from kvdiag.engines.vllm import kv

    view, states, groups = kv.runner_view(worker.model_runner, cfg, num_blocks, lambda: list(free),
                                          lambda: list(used))
    if states:
        if owners is None:
            raise kv.KVAccessError("a hybrid model's state blocks were not tracked in the engine core")
        view.states = states
        view.state_blocks = lambda: {b for b, g in owners.items() if g in groups}
    return fn(view, *args)


def layer_specs(worker) -> list[dict]:
    """In one worker: its cache layers as the storage audit's dicts (``specs.layer_specs``), for its shard."""
    from kvdiag.engines.vllm import specs

    return specs.layer_specs(worker.model_runner)


SHARD_BYTES = ("bytes_per_token", "bytes_per_sequence")  # what each worker holds a share of


def whole_layers(per_worker: list[list[dict]]) -> list[dict]:
    """The engine's layers from its workers' (the same layers in each): each layer's bytes summed over the workers,
    with ``shards``, the number of workers that hold a part of it."""
    out = []
    for parts in zip(*per_worker):
        row = dict(parts[0], shards=len(parts))
        for key in SHARD_BYTES:
            if row.get(key) is not None:
                row[key] = sum(p[key] for p in parts)
        out.append(row)
    return out


def remote(llm) -> bool:
    """Whether the model runners are in worker processes of their own (vLLM's MultiprocExecutor or Ray), not here."""
    from kvdiag.engines.vllm import kv

    try:
        executor = kv.engine_core(llm).model_executor
    except kv.KVAccessError:
        return False
    return getattr(executor, "driver_worker", None) is None


def ask(llm, fn, *args) -> list | None:
    """``fn(worker, *args)`` in every worker process (``collective_rpc``), in rank order; None when the workers are in
    this process (the engine's own views reach them) or the engine core is not here."""
    if not remote(llm):
        return None
    return list(llm.collective_rpc(fn, timeout=RPC_TIMEOUT_S, args=args))


def views_call(llm, fn, *args) -> list:
    """``fn(view, *args)`` on each worker's KV cache (:func:`on_view`), with the engine core's block pool now (and,
    for a hybrid, which blocks hold states)."""
    from kvdiag.engines.vllm import hybrid, kv

    core = kv.engine_core(llm)
    manager, cfg = core.scheduler.kv_cache_manager, core.scheduler.kv_cache_config
    pool = manager.block_pool
    stateful = any(hybrid.is_state(spec) for _, spec in hybrid.layer_specs(cfg).values())
    owners = dict(hybrid.track_owners(manager.coordinator)) if stateful else None  # from the first call on
    return ask(llm, on_view, fn, cfg, pool.num_gpu_blocks, kv.free_blocks(pool), kv.used_blocks(pool), owners, args)
