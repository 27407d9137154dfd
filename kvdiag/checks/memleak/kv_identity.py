"""memleak's KV cache by identity (docs/DESIGN.md, "memleak"): during the workload, the storages of the engine's KV
cache and scale tensors, from the engine's own KV view (``kv_blocks()``), kept as identities only (device,
data_ptr, nbytes: :func:`kvdiag.measure.memory.storage_key`), never as references. After shutdown, any of them that
the census still sees fails the case whatever its size, with what holds it (:mod:`kvdiag.measure.holders`): the
size-based retention limit is for allocator and driver noise, and a small model's whole KV cache sits under it.

Where the cache is in the engine's worker processes (vLLM under tensor parallelism), the identities are asked inside
them (``worker_states()``, vLLM's ``collective_rpc``) and keyed by worker pid. A process's GPU memory goes with it, so
after shutdown a worker's KV cache survives only in a worker still alive that still holds at least its size (NVML).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiag.checks.common import detector_disabled
from kvdiag.checks.memleak.kv_shape import Geometry, geometry
from kvdiag.errors import first_line
from kvdiag.measure.memory import Census, MiB, storage_key, to_mib

DETECTOR = "memleak.kv_identity"


@dataclass
class KVRecord:
    """One cycle's KV cache, by identity."""

    storages: frozenset  # (device, data_ptr, nbytes) of the KV cache and scale tensors during the workload
    left: frozenset = frozenset()  # those the census still sees after shutdown
    holders: list = field(default_factory=list)  # kvdiag.measure.holders.Holder of those left, largest first
    workers: dict = field(default_factory=dict)  # pid -> GPU, when the cache is in the engine's worker processes
    geometry: Geometry | None = None  # blocks, slots, heads, layers of the view (kv_shape.py); None in workers

    @property
    def bytes(self) -> int:
        return sum(s[2] for s in self.storages)

    @property
    def left_bytes(self) -> int:
        return sum(s[2] for s in self.left)


def record(engine) -> tuple[KVRecord | None, str | None]:
    """The identities of the engine's KV cache and scale tensors now; (None, why) when the engine gives no KV view."""
    try:
        view = engine.kv_blocks()
    except Exception as e:  # noqa: BLE001 - an engine without KV access may raise rather than give None
        return None, f"kv_blocks() raised {type(e).__name__}: {first_line(e)[:200]}"
    if view is None:
        return in_workers(engine)
    keys = {storage_key(t) for layer in view.layers for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)
            if t is not None}
    keys = frozenset(k for k in keys if k is not None and k[2] > 0)
    return (KVRecord(keys, geometry=geometry(view)), None) if keys else (None, "kv_blocks() holds no tensor storage")


def in_workers(engine) -> tuple[KVRecord | None, str | None]:
    """The KV cache's identities inside the engine's worker processes; (None, why) when it has none to ask."""
    from kvdiag.engines.protocol import WorkerProcesses

    try:
        states = engine.worker_states() if isinstance(engine, WorkerProcesses) else None
    except Exception as e:  # noqa: BLE001 - a worker that cannot answer leaves the cache judged by size
        return None, f"the worker processes did not answer: {type(e).__name__}: {first_line(e)[:200]}"
    if not states:
        return None, f"{type(engine).__name__}.kv_blocks() gave None (no KV access)"
    keys = frozenset((f"pid {w['pid']} {dev}", ptr, n) for w in states for dev, ptr, n in w["kv"])
    if not keys:
        return None, "the worker processes hold no KV cache storage"
    return KVRecord(keys, workers={w["pid"]: w.get("gpu") for w in states}), None


def check(kv: KVRecord, now: Census, named_roots: dict[int, str], processes: dict | None = None) -> None:
    """After shutdown: which of the recorded storages the census ``now`` still sees, and what holds them; for a cache
    in worker processes, ``processes`` (the after-shutdown snapshot's: pid -> {"cmd", "gpu_mib"}) says."""
    if detector_disabled(DETECTOR):
        return
    if kv.workers:
        kv.left, kv.holders = left_in_workers(kv, processes or {})
        return
    kv.left = frozenset(s for s in kv.storages if now.storages.get(s[:2]) == s[2])
    if kv.left:
        from kvdiag.measure.holders import holders

        alive = {s[:2] for s in kv.left}
        kv.holders = holders({k for k in now.keys if k[1:] in alive}, named_roots)


def left_in_workers(kv: KVRecord, processes: dict) -> tuple[frozenset, list]:
    """The storages of workers alive after shutdown that still hold at least their KV cache's size on the GPU (NVML;
    unknown: counted), and each such worker as a holder."""
    from kvdiag.measure.holders import Holder

    left, held = set(), []
    for pid, gpu in kv.workers.items():
        mine = {s for s in kv.storages if s[0].startswith(f"pid {pid} ")}
        size, p = sum(s[2] for s in mine), processes.get(pid)
        if p is None or (p.get("gpu_mib") is not None and p["gpu_mib"] * MiB < size):
            continue
        left |= mine
        held.append(Holder(f"vLLM worker process pid {pid} `{p.get('cmd', '')}` (GPU {gpu}), alive after shutdown",
                           "its model runner's kv_caches", bytes=size, count=len(mine)))
    return frozenset(left), sorted(held, key=lambda h: -h.bytes)


def findings(rec, cycles: list) -> None:
    """Metrics per cycle; an error ``kv_cache_survived`` when any cycle's KV cache outlived its shutdown; an info
    finding, once, when the engine gave no KV view (the KV cache is then judged by size only)."""
    kvs = [c.kv for c in cycles]
    rec.metrics.update({
        "kv_cache_storages": [None if k is None else len(k.storages) for k in kvs],
        "kv_cache_mib": [None if k is None else to_mib(k.bytes) for k in kvs],
        "kv_survived_storages": [None if k is None else len(k.left) for k in kvs],
        "kv_survived_mib": [None if k is None else to_mib(k.left_bytes) for k in kvs],
        "kv_cache_processes": [None if k is None else len(k.workers) or 1 for k in kvs],
        "kv_worker_pids": [sorted(k.workers) if k is not None and k.workers else None for k in kvs]})
    unknown = next((c.kv_unknown for c in cycles if c.kv_unknown), None)
    if unknown:
        rec.add("info", "kv_identity_unknown", f"the KV cache is not known by identity ({unknown}): a KV cache that "
                "survives shutdown is judged by its size only", reason=unknown)
    hit = [(n, k) for n, k in enumerate(kvs, 1) if k is not None and k.left]
    if not hit:
        return
    n, kv = hit[-1]
    where = "inside its worker processes" if kv.workers else "from the engine's KV view"
    names = "; ".join(f"{h.holder}: {h.bytes / MiB:.3g} MiB" for h in kv.holders)
    rec.add("error", "kv_cache_survived", f"the engine's KV cache survives shutdown: {len(kv.left)} of its "
            f"{len(kv.storages)} KV cache and scale storages ({kv.left_bytes / MiB:.3g} of {kv.bytes / MiB:.3g} MiB) "
            f"are still alive after shutdown (cycle {n}), held by {names}; known by identity {where}, a failure "
            "whatever the size", cycle=n, storages=len(kv.storages), survived=len(kv.left),
            mib=to_mib(kv.bytes), survived_mib=to_mib(kv.left_bytes), cycles=[m for m, _ in hit],
            holder=kv.holders[0].holder if kv.holders else None, holders=[h.to_json() for h in kv.holders])
