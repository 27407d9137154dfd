"""GPU memory vLLM keeps after an in-process shutdown outside any Python object: the pool of its sleep-mode
allocator. ``CuMemAllocator`` is a process-wide singleton whose ``pointer_to_data`` maps every live
allocation (handle: device, size, ...) with its tag; nothing in vLLM releases it when the engine shuts down.
"""

from __future__ import annotations

import sys

CUMEM_MODULE = "vllm.device_allocator.cumem"


def sleep_pool() -> dict | None:
    """``{"holder", "bytes", "allocations", "tags"}`` of the sleep-mode allocator's pool, when the allocator was
    created in this process and still maps memory; else None. Reads only what vLLM already imported."""
    module = sys.modules.get(CUMEM_MODULE)
    instance = getattr(getattr(module, "CuMemAllocator", None), "instance", None)
    data = dict(getattr(instance, "pointer_to_data", None) or {})
    if not data:
        return None
    tags: dict[str, int] = {}
    for d in data.values():
        tags[d.tag] = tags.get(d.tag, 0) + int(d.handle[1])
    return {"holder": "vLLM's sleep-mode allocator pool (CuMemAllocator, a process-wide singleton)",
            "bytes": sum(tags.values()), "allocations": len(data), "tags": tags}
