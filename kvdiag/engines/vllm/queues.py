"""The zmq contexts of vLLM's worker message queues, closed after its shutdown (tensor parallelism).

vLLM's MultiprocExecutor talks to its worker processes through ``MessageQueue``s (``shm_broadcast.py``), each with a
zmq context of its own. Its ``shutdown()`` stops the workers and drops the queues without closing their sockets, so
the contexts are destroyed by the garbage collector, and zmq's ``term()`` waits for every unsent message (LINGER -1)
to reach a peer: in kvdiag's worker the ``gc.collect()`` after shutdown hung there (docs/vllm-gpu-results.md,
"Figures behind the code"). vLLM's engine-core client closes its own sockets explicitly for this reason; kvdiag
does the same for the executor's queues, with LINGER 0, after vLLM's shutdown ran.
"""

from __future__ import annotations

SOCKETS = ("local_socket", "remote_socket")  # a MessageQueue's sockets
WAKE_SOCKETS = ("local_notify_socket", "read_cancel_socket", "write_cancel_socket")  # its SpinCondition's


def executor_contexts(llm) -> list:
    """The zmq contexts of the executor's message queues (the rpc broadcast, the workers' responses); none where the
    workers run in this process. Taken before shutdown: vLLM's drops its references to the queues."""
    from kvdiag.engines.vllm import kv

    try:
        executor = kv.engine_core(llm).model_executor
    except kv.KVAccessError:
        return []
    queues = [getattr(executor, "rpc_broadcast_mq", None), *(getattr(executor, "response_mqs", None) or []),
              *(getattr(w, "worker_response_mq", None) for w in getattr(executor, "workers", None) or [])]
    contexts = {}
    for mq in filter(None, queues):
        wake = getattr(mq, "_spin_condition", None)
        for owner, names in ((mq, SOCKETS), (wake, WAKE_SOCKETS)):
            for name in names:
                sock = getattr(owner, name, None) if owner is not None else None
                ctx = getattr(sock, "context", None)
                if ctx is not None:
                    contexts[id(ctx)] = ctx
    return list(contexts.values())


def close(contexts: list) -> None:
    """Close each context's sockets with LINGER 0 and terminate it."""
    for ctx in contexts:
        if not ctx.closed:
            ctx.destroy(linger=0)
