"""Memory around a sleep/wake cycle, judged on the device the KV cache lives on.

Snapshots come from :mod:`kvdiag.measure.memory` (RSS, tensor census by device, and on CUDA
``memory_allocated``/``reserved``, the driver's and NVML's views). ``judge`` decides on
CUDA by whichever of ``memory_allocated`` and the driver's used memory shows the sleep: an
engine that frees its tensors shows it in ``memory_allocated``; vLLM's sleep-mode allocator
unmaps the memory under live tensors, so only the driver sees it (``memory_allocated`` does not
move). Elsewhere by the census of tensors on the cache's device; RSS is reported, never judged.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

MiB = 1 << 20


def measure(device, stage: str, cycle: int):
    """A :class:`kvdiag.measure.memory.Snapshot` after a garbage collection (no ``empty_cache``: what the
    engine hands back to the driver is its own doing)."""
    from kvdiag.measure.memory import snapshot

    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return snapshot(stage, cycle, cuda=device.type == "cuda", frozen=False)


def judged(snap, device, measure: str = "cuda_allocated") -> int:
    """The bytes a verdict is taken on: a CUDA measure (``cuda_allocated`` or ``driver_used``), else the census on
    ``device``."""
    if getattr(snap, measure, None) is not None:
        return getattr(snap, measure)
    return snap.by_device.get(str(device), {}).get("bytes", 0)


def sleep_measure(before, asleep, expected: int | None = None, freed_min: float = 0.9) -> str:
    """The CUDA measure that shows what a sleep freed: ``cuda_allocated`` when the caching allocator saw the sleep
    (at least ``freed_min`` of ``expected`` gone, or, with nothing expected, at least half of what the driver saw),
    else ``driver_used`` when the driver saw more go (vLLM's sleep mode unmaps memory under live tensors:
    ``memory_allocated`` does not move). The driver's view also moves with the caching allocator's cache and in
    2 MiB pages, so an engine that frees its tensors is judged on ``cuda_allocated``."""
    if before.driver_used is None or before.cuda_allocated is None:
        return "cuda_allocated"
    by_alloc = before.cuda_allocated - asleep.cuda_allocated
    by_driver = before.driver_used - asleep.driver_used
    shown = by_alloc >= freed_min * expected if expected else by_alloc >= 0.5 * by_driver
    return "cuda_allocated" if shown or by_driver <= by_alloc else "driver_used"


def weight_bytes(engine, device) -> int | None:
    """Bytes of the model weights on ``device``: the engine's own ``weight_bytes()`` if it has one,
    else the parameters of the torch modules it holds; None when it shows neither."""
    from kvdiag.engines.protocol import WeightBytes

    if isinstance(engine, WeightBytes):
        return engine.weight_bytes()
    import torch

    modules = [v for v in vars(engine).values() if isinstance(v, torch.nn.Module)]
    if not modules or device is None:
        return None
    seen = {p.data_ptr(): p.nbytes for m in modules for p in m.parameters() if p.device == device}
    return sum(seen.values())


@dataclass
class Verdict:
    freed: int
    restored_delta: int  # awake - before (judged bytes)
    freed_ok: bool | None  # None: no expected size to judge against
    restored: bool
    snapshots: dict
    problems: list = field(default_factory=list)  # (kind, message)
    measure: str = "cuda_allocated"  # what freed/restored were judged on (CUDA; else the census)

    def row(self) -> dict:
        return {"freed_bytes": self.freed, "freed_ok": self.freed_ok, "restored": self.restored,
                "restored_delta_bytes": self.restored_delta, "judged_on": self.measure, "memory": self.snapshots}


def judge(device, before, asleep, awake, expected: int | None, freed_min: float, tol: float) -> Verdict:
    """Was ``expected`` freed (at least ``freed_min`` of it) asleep, and did memory come back to
    within ``tol`` of what was freed (or expected) when awake?"""
    m = sleep_measure(before, asleep, expected, freed_min)
    freed = judged(before, device, m) - judged(asleep, device, m)
    delta = judged(awake, device, m) - judged(before, device, m)
    scale = max(expected or 0, freed, MiB)
    v = Verdict(freed, delta, None if not expected else freed >= freed_min * expected, abs(delta) <= tol * scale,
                {s.stage: s.row() for s in (before, asleep, awake)}, measure=m)
    if v.freed_ok is False:
        v.problems.append(("not_freed", f"asleep, {freed / MiB:.1f} MiB freed of {expected / MiB:.1f} MiB expected "
                                        f"(< {freed_min:.0%})"))
    if not v.restored:
        what = "more" if delta > 0 else "less"
        v.problems.append(("not_restored", f"awake, {abs(delta) / MiB:.1f} MiB {what} than before sleep"))
    return v
