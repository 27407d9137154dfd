"""Memory snapshots, a census of live tensors, and the holders of tensors that survive (docs/DESIGN.md,
"Measuring memory").

A :class:`Snapshot` takes, where present: process RSS, ``gc.get_freeze_count()``, the
tensor census (live tensors by device; bytes counted once per storage), and on CUDA
``torch.cuda.memory_allocated/reserved``, the driver's used memory (``mem_get_info``)
and NVML's per-process usage. :func:`survivors` compares two censuses; :func:`holders`
(in :mod:`kvdiag.measure.holders`) names what keeps the survivors alive.

Objects frozen by ``gc.freeze()`` are invisible to ``gc.get_objects()``: tensors created
before the freeze do not show in the census at all.
"""

from __future__ import annotations

import gc
import os
from dataclasses import asdict, dataclass, field

from kvdiag.gpus import current_gpu
from kvdiag.measure.processes import children, gpu_view

MiB = 1 << 20
SMALL_TENSOR_BYTES = 4096  # survivors below this are counted, not attributed


def to_mib(n, digits: int = 3) -> float | None:
    """Bytes as MiB, rounded; None stays None."""
    return None if n is None else round(n / MiB, digits)


@dataclass
class Census:
    """Live tensors visible to gc: ``keys`` = (id, device, storage ptr) per tensor, ``storages`` = bytes."""

    keys: frozenset = frozenset()
    storages: dict = field(default_factory=dict)  # (device, ptr) -> nbytes

    @property
    def count(self) -> int:
        return len(self.keys)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def by_device(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for _, dev, _ in self.keys:
            out.setdefault(dev, {"count": 0, "bytes": 0})["count"] += 1
        for (dev, _), n in self.storages.items():
            out.setdefault(dev, {"count": 0, "bytes": 0})["bytes"] += n
        return out


def storage_key(t) -> tuple[str, int, int] | None:
    """(device, storage data_ptr, storage nbytes) of a tensor; None where there is no real storage (meta, sparse,
    torch.compile's fake tensors, whose sizes may be symbolic)."""
    import torch

    try:
        if t.layout is not torch.strided or t.device.type == "meta" or getattr(t, "fake_mode", None) is not None:
            return None
        s = t.untyped_storage()
        ptr, n = s.data_ptr(), s.nbytes()
        return (str(t.device), ptr, n) if type(ptr) is int and type(n) is int else None
    except Exception:  # noqa: BLE001 - fake, functional or otherwise storage-less tensors
        return None


def live_tensors(keys=None) -> list:
    """Every live tensor gc can see (optionally only those whose census key is in ``keys``)."""
    import torch

    objs = gc.get_objects()
    tensor_types = {tp for tp in set(map(type, objs)) if issubclass(tp, torch.Tensor)}  # the test once per type
    out = [o for o in objs if type(o) in tensor_types]  # (~850k objects with vLLM imported: 2x faster)
    del objs
    if keys is not None:
        out = [o for o in out if (st := storage_key(o)) is not None and (id(o), st[0], st[1]) in keys]
    return out


def take_census() -> Census:
    keys, storages = set(), {}
    for t in live_tensors():
        st = storage_key(t)
        if st is not None:
            keys.add((id(t), st[0], st[1]))
            storages[st[:2]] = max(st[2], storages.get(st[:2], 0))
    return Census(frozenset(keys), storages)


@dataclass
class Survivors:
    """Tensors present now that were not in the baseline, with storages the baseline did not hold."""

    keys: frozenset  # census keys of the large ones (storage >= floor)
    bytes: int  # their storages, each once
    small_keys: frozenset  # survivors under the floor: counted, attributed only when their count grows
    small_bytes: int
    by_device: dict  # device -> bytes of the large ones

    @property
    def count(self) -> int:
        return len(self.keys)

    @property
    def small_count(self) -> int:
        return len(self.small_keys)


def survivors(base: Census, now: Census, floor: int = SMALL_TENSOR_BYTES) -> Survivors:
    large, small = set(), set()
    sizes: dict[tuple, int] = {}
    for key in now.keys - base.keys:
        st = key[1:]
        if st in base.storages:  # a new view of memory the baseline already held
            continue
        sizes[st] = now.storages.get(st, 0)
        (large if sizes[st] >= floor else small).add(key)
    by_device: dict[str, int] = {}
    for (dev, _), n in sizes.items():
        if n >= floor:
            by_device[dev] = by_device.get(dev, 0) + n
    return Survivors(frozenset(large), sum(by_device.values()), frozenset(small),
                     sum(n for n in sizes.values() if n < floor), by_device)


@dataclass
class Snapshot:
    stage: str  # baseline | after-workload | after-shutdown
    cycle: int  # 0 for the baseline
    rss: int
    frozen: int | None  # gc.get_freeze_count(); None when not asked (it walks every frozen object: ~0.1 s with vLLM)
    tensors: int
    tensor_bytes: int
    by_device: dict
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None  # max_memory_allocated since the last reset
    driver_used: int | None = None  # used memory of the engine's GPUs, the driver's view (engine_processes.py)
    nvml_process: int | None = None  # GPU memory of this process and every process it started, NVML's view
    gpus: dict | None = None  # GPU -> {"used_mib", "engine_mib"} (NVML)
    processes: dict | None = None  # pid -> {"cmd", "gpu_mib"}: the live processes this process started

    def to_json(self) -> dict:
        return asdict(self)

    def row(self) -> dict:
        """The table columns, in MiB (None where the column does not apply)."""
        mib = lambda v: to_mib(v, 2)  # noqa: E731
        return {"cycle": self.cycle, "stage": self.stage, "tensors": self.tensors,
                "tensor_mib": mib(self.tensor_bytes), "rss_mib": mib(self.rss),
                "cuda_allocated_mib": mib(self.cuda_allocated), "cuda_reserved_mib": mib(self.cuda_reserved),
                "driver_used_mib": mib(self.driver_used), "nvml_process_mib": mib(self.nvml_process),
                "processes": None if self.processes is None else len(self.processes), "frozen": self.frozen}


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def cleanup(cuda: bool, collect: bool = True) -> None:
    """The standard cleanup after an engine shuts down; glibc's free heap goes back to the OS too
    (as ``empty_cache`` does for CUDA), so RSS shows what is held rather than what malloc keeps cached.
    ``collect=False``: without the ``gc.collect()``, for an engine whose ``shutdown()`` just ran one
    (``shutdown_collects``: a second full collection right after finds nothing and costs ~0.3 s with vLLM)."""
    if collect:
        gc.collect()
    trim_malloc()
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def trim_malloc() -> None:
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # musl or another libc: nothing to trim
            pass


def snapshot(stage: str, cycle: int, cuda: bool = False, census: Census | None = None,
             frozen: bool = True) -> Snapshot:
    """What the process holds now; ``frozen``: also count the objects ``gc.freeze()`` froze (memleak's baseline and
    after-shutdown snapshots need it; the count walks every frozen object, ~85 ms in a process where vLLM froze its
    start-up objects, so a snapshot taken while an engine runs leaves it out)."""
    census = census if census is not None else take_census()
    snap = Snapshot(stage, cycle, rss_bytes(), gc.get_freeze_count() if frozen else None, census.count,
                    census.bytes, census.by_device())
    kids = children()
    snap.processes = {pid: {"cmd": cmd, "gpu_mib": None} for pid, cmd in kids.items()}
    if cuda:
        import torch

        free, total = torch.cuda.mem_get_info()
        snap.cuda_allocated = torch.cuda.memory_allocated()
        snap.cuda_reserved = torch.cuda.memory_reserved()
        snap.cuda_peak = torch.cuda.max_memory_allocated()
        snap.driver_used = total - free
        view = gpu_view([os.getpid(), *kids])
        if view is not None:
            for pid, p in snap.processes.items():
                p["gpu_mib"] = round(view.by_pid.get(pid, 0) / MiB, 2) if view.matched and view.engine else None
            gpus = view.measured(current_gpu())
            if gpus:  # else NVML and CUDA disagree on the device: the driver's view of the current one stays
                snap.driver_used = sum(view.used[g] for g in gpus)
            snap.nvml_process = view.engine_bytes()
            snap.gpus = {g: {"used_mib": round(n / MiB, 2), "engine_mib": round(view.engine.get(g, 0) / MiB, 2)}
                         for g, n in view.used.items()}
    return snap


def release_cublas_workspaces() -> int | None:
    """Free torch's cuBLAS workspaces and return the CUDA allocated bytes that gave back; None where torch cannot.

    torch keeps one workspace per cuBLAS handle and CUDA stream for the life of the process (32 MiB each on
    Hopper) and frees them only here; an engine that creates a new stream at every start (vLLM captures its
    CUDA graphs on one) adds one at every start."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    clear()
    return before - torch.cuda.memory_allocated()


def private_pool_bytes() -> int:
    """CUDA memory the caching allocator keeps in private pools (CUDA graph pools, ``MemPool``s such as vLLM's
    sleep-mode allocator) rather than in the default pool: segments whose pool id is not (0, 0)."""
    import torch

    return sum(int(seg.get("total_size", 0)) for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0))
