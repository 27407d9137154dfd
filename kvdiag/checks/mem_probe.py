"""Memory around a sleep/wake cycle, judged on the device the KV cache lives on.

Snapshots come from :mod:`kvdiag.memory` (RSS, tensor census by device, and on CUDA
``memory_allocated``/``reserved``, the driver's and NVML's views). ``judge`` decides on
CUDA by ``memory_allocated``, elsewhere by the census of tensors on the cache's device;
RSS is reported, never judged (too noisy).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

MiB = 1 << 20


def measure(device, stage: str, cycle: int):
    """A :class:`kvdiag.memory.Snapshot` after a garbage collection (no ``empty_cache``: what the
    engine hands back to the driver is its own doing)."""
    from kvdiag.memory import snapshot

    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return snapshot(stage, cycle, cuda=device.type == "cuda")


def judged(snap, device) -> int:
    """The bytes a verdict is taken on: CUDA's allocated bytes, else the census on ``device``."""
    if snap.cuda_allocated is not None:
        return snap.cuda_allocated
    return snap.by_device.get(str(device), {}).get("bytes", 0)


def weight_bytes(engine, device) -> int | None:
    """Bytes of the model weights on ``device``: the engine's own ``weight_bytes()`` if it has one,
    else the parameters of the torch modules it holds; None when it shows neither."""
    own = getattr(engine, "weight_bytes", None)
    if callable(own):
        return own()
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

    def row(self) -> dict:
        return {"freed_bytes": self.freed, "freed_ok": self.freed_ok, "restored": self.restored,
                "restored_delta_bytes": self.restored_delta, "memory": self.snapshots}


def judge(device, before, asleep, awake, expected: int | None, freed_min: float, tol: float) -> Verdict:
    """Was ``expected`` freed (at least ``freed_min`` of it) asleep, and did memory come back to
    within ``tol`` of what was freed (or expected) when awake?"""
    freed = judged(before, device) - judged(asleep, device)
    delta = judged(awake, device) - judged(before, device)
    scale = max(expected or 0, freed, MiB)
    v = Verdict(freed, delta, None if not expected else freed >= freed_min * expected, abs(delta) <= tol * scale,
                {s.stage: s.row() for s in (before, asleep, awake)})
    if v.freed_ok is False:
        v.problems.append(("not_freed", f"asleep, {freed / MiB:.1f} MiB freed of {expected / MiB:.1f} MiB expected "
                                        f"(< {freed_min:.0%})"))
    if not v.restored:
        what = "more" if delta > 0 else "less"
        v.problems.append(("not_restored", f"awake, {abs(delta) / MiB:.1f} MiB {what} than before sleep"))
    return v
