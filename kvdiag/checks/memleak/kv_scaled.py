"""memleak's survivors sized by the KV cache (docs/DESIGN.md, "memleak"): a tensor storage allocated during the
engine's life that survives its shutdown and is at least ``KV_SHARE`` of the engine's KV cache (its ``kv_blocks()``
view during the workload; at least ``FLOOR``) fails the case, whatever the retention limit says. Such a storage is
sized by the cache (a per-token scale, a copy of a block table or of the cache itself): kvdiag's small explicit KV
cache keeps it under the absolute limit, a user's 60 GiB cache makes it gigabytes. A process-lifetime cache of
constant size (compiled graphs' constants, Triton's 64 KiB buffer cache) stays a warning: each of its storages is
far under 1% of a KV cache.
"""

from __future__ import annotations

from kvdiag.measure.memory import Census, MiB, Survivors

KV_SHARE = 0.01
FLOOR = 256 << 10  # below this a storage says nothing about the cache's size (a tiny cache's 1% is a few KiB)


def limit(kv_bytes: int) -> int:
    return max(FLOOR, int(KV_SHARE * kv_bytes))


def keys(s: Survivors, now: Census, kv) -> frozenset:
    """Census keys of the survivors whose storage is at least ``limit`` of the recorded KV cache ``kv``
    (a :class:`kvdiag.checks.memleak.kv_identity.KVRecord`), the KV cache's own storages left out (kv_identity's)."""
    if kv is None or not kv.bytes:
        return frozenset()
    own = {st[:2] for st in kv.storages}
    return frozenset(k for k in s.keys if k[1:] not in own and now.storages.get(k[1:], 0) >= limit(kv.bytes))


def findings(rec, cycles: list) -> None:
    """One error ``kv_scaled_survived`` for the last cycle that left such storages, with their holders."""
    hit = [(n, c) for n, c in enumerate(cycles, 1) if c.kv_scaled]
    if not hit:
        return
    n, c = hit[-1]
    kv = c.kv.bytes
    total = sum(h.bytes for h in c.kv_scaled)
    names = "; ".join(f"{h.holder}: {h.bytes / MiB:.3g} MiB in {h.count} storage(s)" for h in c.kv_scaled)
    rec.add("error", "kv_scaled_survived", f"{total / MiB:.3g} MiB survive shutdown in storages each at least "
            f"{limit(kv) / MiB:.3g} MiB ({KV_SHARE:.0%} of the engine's {kv / MiB:.4g} MiB KV cache) (cycle {n}), "
            f"held by {names}; an allocation sized by the KV cache grows with it (with a 60 GiB cache: "
            f"{total / kv * 60:.2g} GiB), so it fails whatever the retention limit", cycle=n,
            mib=round(total / MiB, 3), kv_cache_mib=round(kv / MiB, 3), share=round(total / kv, 4),
            limit_mib=round(limit(kv) / MiB, 3), cycles=[m for m, _ in hit],
            holder=c.kv_scaled[0].holder, holders=[h.to_json() for h in c.kv_scaled])
