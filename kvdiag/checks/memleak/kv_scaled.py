"""memleak's survivors sized by the KV cache (docs/DESIGN.md, "memleak"), judged per holder: the tensor storages
allocated during the engine's life that survive its shutdown are grouped by what holds them (one module global,
object, closure or ``lru_cache``: :mod:`kvdiag.measure.holders`) and summed; a holder whose storages together are at
least ``KV_SHARE`` of the engine's KV cache (its ``kv_blocks()`` view during the workload; at least ``FLOOR``) fails
the case, whatever the retention limit says. Such an allocation is sized by the cache (a per-token scale, a copy of
a block table or of the cache itself): kvdiag's small explicit KV cache keeps it under the absolute limit, a user's
60 GiB cache makes it gigabytes. Summed, because one side tensor per layer, each well under 1% of the cache, is the
same leak cut into pieces (issue 67: 4 storages of 0.76% each on zoo:qwen3). A process-lifetime cache of constant
size (Triton's 64 KiB buffer cache) stays a warning: all of it is far under 1% of a KV cache; one over 1% of a small
cache (compiled vLLM's ``torch._dynamo`` cached backends) fails, unless ``--kv-sizes`` measured it the same at both
sizes (``kv_ratio.constant``). The KV cache's own storages are left out: ``kv_identity.py`` judges them.
"""

from __future__ import annotations

from kvdiag.measure.memory import MiB, Survivors

KV_SHARE = 0.01
FLOOR = 256 << 10  # below this a holder's bytes say nothing about the cache's size (a tiny cache's 1% is a few KiB)


def limit(kv_bytes: int) -> int:
    return max(FLOOR, int(KV_SHARE * kv_bytes))


def candidates(s: Survivors, kv, small: bool = False) -> frozenset:
    """Census keys of the survivors (``small``: those under the census's floor too) that are not the recorded KV
    cache's own storages (``kv``: a :class:`kvdiag.checks.memleak.kv_identity.KVRecord` or None)."""
    keys = s.keys | s.small_keys if small else s.keys
    if kv is None:
        return keys
    own = {st[:2] for st in kv.storages}
    return frozenset(k for k in keys if k[1:] not in own)


def over(side: list, kv) -> list:
    """The holders among ``side`` (:class:`kvdiag.measure.holders.Holder` of the candidates) whose storages together
    hold at least ``limit`` of the recorded KV cache."""
    if kv is None or not kv.bytes:
        return []
    return [h for h in side if h.bytes >= limit(kv.bytes)]


def findings(rec, cycles: list) -> None:
    """One error ``kv_scaled_survived`` for the last cycle that left such holders, each with its storages; a holder
    that ``--kv-sizes`` measured the same at both sizes is left out (kv_ratio.py: not sized by the cache)."""
    from kvdiag.checks.memleak import kv_ratio

    constant = kv_ratio.constant(cycles)
    hit = [(n, c) for n, c in enumerate(cycles, 1) if [h for h in c.kv_scaled if h.holder not in constant]]
    if not hit:
        return
    n, c = hit[-1]
    scaled = [h for h in c.kv_scaled if h.holder not in constant]
    kv = c.kv.bytes
    total = sum(h.bytes for h in scaled)
    largest = max(h.largest for h in scaled)
    names = "; ".join(f"{h.holder}: {h.bytes / MiB:.3g} MiB in {h.count} storage(s), the largest "
                      f"{h.largest / MiB:.3g} MiB" for h in scaled)
    split = f"; each storage is under {KV_SHARE:.0%}: one leak cut into pieces, summed per holder" \
        if largest < limit(kv) else ""
    rec.add("error", "kv_scaled_survived", f"{total / MiB:.3g} MiB survive shutdown held by holders that each keep "
            f"at least {limit(kv) / MiB:.3g} MiB ({KV_SHARE:.0%} of the engine's {kv / MiB:.4g} MiB KV cache) "
            f"(cycle {n}): {names}{split}; an allocation sized by the KV cache grows with it (with a 60 GiB cache: "
            f"{total / kv * 60:.2g} GiB), so it fails whatever the retention limit", cycle=n,
            mib=round(total / MiB, 3), kv_cache_mib=round(kv / MiB, 3), share=round(total / kv, 4),
            limit_mib=round(limit(kv) / MiB, 3), largest_storage_mib=round(largest / MiB, 3),
            cycles=[m for m, _ in hit], holder=scaled[0].holder, holders=[h.to_json() for h in scaled])
