"""Where an engine's KV cache is, and a function run on it there: in the case's process (the view of
``kv_blocks()``), or in each of the engine's worker processes on its shard of the heads (vLLM under tensor
parallelism: the engine's ``on_kv``). A step run this way answers with plain numbers: a worker's answer crosses
processes, and what it keeps between steps (a fingerprint) stays in the process that holds the cache."""

from __future__ import annotations


def in_workers(engine) -> bool:
    """Whether the engine's KV cache is in worker processes of its own (reached by its ``on_kv``)."""
    from kvdiag.engines.protocol import WorkerProcesses

    return isinstance(engine, WorkerProcesses) and bool(engine.kv_in_workers())


def on_kv(engine, fn, *args) -> list:
    """``fn(view, *args)`` where the engine's KV cache is: one result per process that holds a part of it. Raises
    EngineUnsupported when the cache is out of reach."""
    if in_workers(engine):
        return engine.on_kv(fn, *args)
    view = engine.kv_blocks()
    if view is None:
        from kvdiag.errors import EngineUnsupported

        raise EngineUnsupported(engine.capabilities.kv_access_reason or "the engine gives no access to its KV cache")
    return [fn(view, *args)]


def workers_problem(engine) -> str | None:
    """None when each of the engine's worker processes can view its shard of the KV cache, else why not (vLLM wraps
    a worker's KVAccessError in a RuntimeError: its first line)."""
    from kvdiag.errors import first_line

    try:
        on_kv(engine, _blocks)
    except Exception as e:  # noqa: BLE001 - whatever a worker raised is the reason
        return first_line(e)[:300]
    return None


def _blocks(view) -> int:
    return view.num_blocks
