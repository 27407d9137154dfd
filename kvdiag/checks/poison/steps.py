"""poison's two steps on one KV view, run where the cache is: in the case's process, or in each of vLLM's worker
processes on its shard of the heads (tensor parallelism; ``kv_where.on_kv``). ``fill`` poisons the free blocks and keeps
the cache's fingerprint in the process that filled it; ``scan`` compares with it after the wave and scans the
slots the wave wrote. Both answer with plain numbers (a worker's answer crosses processes)."""

from __future__ import annotations

from dataclasses import asdict

from kvdiag.checks import kv_tensors
from kvdiag.checks.kv_where import in_workers, workers_problem

_MARKS: dict = {}  # the fingerprint ``fill`` took in this process, for the ``scan`` after the wave


def reachable(engine) -> str | None:
    """None when poison can reach the engine's KV cache (here or in its worker processes), else why not (a worker
    that cannot view its cache says so in its error)."""
    caps = engine.capabilities
    if in_workers(engine):
        problem = workers_problem(engine)
        return problem and f"the worker processes cannot view their KV cache: {problem}"
    if not caps.kv_access or engine.kv_blocks() is None:
        return caps.kv_access_reason or "the engine gives no access to its KV blocks"
    return None


def fill(view, value: str, seed: int) -> dict:
    """Poison the free blocks with ``value``; the blocks, what the fill covers and the view's shape."""
    free = view.free_blocks()
    kv_tensors.fill_blocks(view, free, value, seed)
    _MARKS["marks"] = kv_tensors.slot_fingerprint(view), kv_tensors.state_fingerprint(view)
    return {"free": list(free), "num_blocks": view.num_blocks, "block_size": view.block_size,
            "poisoned": {"kv_layers": len(view.layers), "kv_tensors": len(kv_tensors.cache_tensors(view)),
                         "state_layers": len(view.states),
                         "state_tensors": [n for n, _ in kv_tensors.state_tensors(view)]}}


def scan(view, free: list[int]) -> dict:
    """After the wave: the poisoned blocks it was handed (written), and what the slots it wrote hold. A written
    slot is one whose K, V or scale bytes changed; a block whose state changed is scanned as states, never as K/V
    slots it did not write (a state is one per block: its change says nothing of the block's slots)."""
    import torch

    slots, states = _MARKS.pop("marks")
    changed = kv_tensors.slot_fingerprint(view) != slots
    per_block = changed.view(view.num_blocks, view.block_size).any(1)
    restated = torch.zeros(view.num_blocks, dtype=torch.bool) if states is None else \
        kv_tensors.state_fingerprint(view) != states
    free_ids = torch.as_tensor(free, dtype=torch.long)
    fresh = free_ids[(per_block | restated)[free_ids]]
    states = torch.as_tensor(sorted(view.state_blocks()), dtype=torch.long)
    s = kv_tensors.scan_slots(view, changed.nonzero().flatten(), restated.nonzero().flatten())
    return {"fresh": fresh.tolist(), "fresh_state_blocks": int(torch.isin(fresh, states).sum()), "scan": asdict(s)}
