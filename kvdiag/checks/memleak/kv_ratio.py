"""memleak ``--kv-sizes A,B`` (docs/DESIGN.md, "memleak"): the cycles run at two KV cache sizes, and what survives
shutdown is compared between the last cycle of each. A holder (:mod:`kvdiag.measure.holders`) whose surviving bytes
changed in the cache's ratio is proportional to the KV cache: proven by the two measurements, not guessed from its
share of one cache. The KV cache's own storages are left out (``kv_identity.py`` judges them by identity); the
cache's bytes are its ``kv_blocks()`` view's at each size (the block counts where the engine gives no view).
"""

from __future__ import annotations

import math

from kvdiag.measure.memory import MiB, to_mib

RATIO_TOL = 0.25  # proportional: ln(bytes ratio) within 25% of ln(KV ratio); a constant survivor has ln 0


def phases(cycles: list) -> list[int | None]:
    """The KV size (blocks) each cycle ran with; None where the case's own."""
    return [getattr(c, "kv_size", None) for c in cycles]


def same_phase_steps(cycles: list, n: int) -> list[int]:
    """Indexes i of the steps i -> i+1 among ``n`` values (one per cycle) that stay at one KV size: growth is judged
    within a size, never across the change of size."""
    size = phases(cycles) + [None] * max(0, n - len(cycles))
    return [i for i in range(n - 1) if size[i] == size[i + 1]]


def proportional(x: int, y: int, kv_ratio: float) -> bool:
    """Whether ``x`` -> ``y`` bytes follow the cache's ratio (within ``RATIO_TOL`` on a log scale)."""
    if x <= 0 or y <= 0 or kv_ratio <= 0 or kv_ratio == 1:
        return False
    return abs(math.log(y / x) - math.log(kv_ratio)) <= RATIO_TOL * abs(math.log(kv_ratio))


def compare(cycles: list) -> dict | None:
    """The two sizes' last cycles side by side (None without two sizes): blocks, cycles, KV MiB and ratio,
    survivor MiB, and per holder its MiB at each size, ratio and verdict (proportional, constant, changed)."""
    sizes = list(dict.fromkeys(s for s in phases(cycles) if s is not None))
    if len(sizes) < 2:
        return None
    sizes = sizes[:2]
    at = [[n for n, c in enumerate(cycles) if c.kv_size == s] for s in sizes]
    a, b = cycles[at[0][-1]], cycles[at[1][-1]]
    kv = [c.kv.bytes if c.kv is not None else None for c in (a, b)]
    kv_ratio = kv[1] / kv[0] if kv[0] and kv[1] else sizes[1] / sizes[0]
    rows = []
    for name in dict.fromkeys([h.holder for h in a.side] + [h.holder for h in b.side]):
        x, y = (next((h.bytes for h in c.side if h.holder == name), 0) for c in (a, b))
        verdict = "proportional" if proportional(x, y, kv_ratio) else "constant" if x == y else "changed"
        rows.append({"holder": name, "bytes": [x, y], "mib": [to_mib(x), to_mib(y)],
                     "ratio": round(y / x, 4) if x else None, "verdict": verdict})
    total = [sum(h.bytes for h in c.side) for c in (a, b)]
    return {"blocks": sizes, "cycles": [[n + 1 for n in ns] for ns in at], "kv_mib": [to_mib(x) for x in kv],
            "kv_ratio": round(kv_ratio, 4), "survivor_mib": [to_mib(x) for x in total],
            "survivor_ratio": round(total[1] / total[0], 4) if total[0] else None,
            "proportional": proportional(*total, kv_ratio), "holders": rows}


def constant(cycles: list) -> set[str]:
    """Holders that ``--kv-sizes`` measured the same at both sizes: proven not sized by the cache, so neither their
    share of one cache nor their shape fails them (none without two sizes)."""
    return {h["holder"] for h in (compare(cycles) or {}).get("holders", ()) if h["verdict"] == "constant"}


def findings(rec, cycles: list) -> None:
    """``metrics.kv_sizes`` (:func:`compare`); an error ``kv_proportional`` naming each holder whose survivors follow
    the cache's ratio (or the survivors together, when no one holder does), else an info finding that none does."""
    cmp = compare(cycles)
    if cmp is None:
        return
    rec.metrics["kv_sizes"] = {k: v for k, v in cmp.items() if k != "holders"} | {
        "holders": [{k: v for k, v in h.items() if k != "bytes"} for h in cmp["holders"]]}
    (na, nb), r = cmp["blocks"], cmp["kv_ratio"]
    kv = cmp["kv_mib"]
    size = f"KV cache {kv[0]:.4g} and {kv[1]:.4g} MiB, ratio" if None not in kv else "no KV view: the blocks' ratio"
    where = f"{na} and {nb} blocks ({size} {r:.3g}; cycles {_span(cmp['cycles'][0])} and {_span(cmp['cycles'][1])})"
    hit = [h for h in cmp["holders"] if h["verdict"] == "proportional"]
    if not hit and cmp["proportional"]:
        x, y = (int(v * MiB) for v in cmp["survivor_mib"])
        hit = [{"holder": "the survivors together (no one holder)", "bytes": [x, y], "mib": cmp["survivor_mib"],
                "ratio": cmp["survivor_ratio"]}]
    if not hit:
        rec.add("info", "kv_sizes", f"at {where} nothing that survives shutdown is in proportion to the KV cache: "
                f"survivors {cmp['survivor_mib'][0]:.3g} and {cmp['survivor_mib'][1]:.3g} MiB", blocks=[na, nb],
                kv_ratio=r, survivor_mib=cmp["survivor_mib"])
        return
    names = "; ".join(f"{h['holder']}: {h['mib'][0]:.3g} → {h['mib'][1]:.3g} MiB (ratio {h['ratio']:.3g})"
                      for h in hit)
    big = sum(h["bytes"][1] for h in hit)
    at60 = f" (with a 60 GiB cache: {big / (kv[1] * MiB) * 60:.2g} GiB)" if kv[1] else ""
    rec.add("error", "kv_proportional", f"what survives shutdown is proportional to the KV cache, measured at "
            f"{where}: {names}; it grows with the user's cache{at60}", blocks=[na, nb], kv_ratio=r,
            kv_cache_mib=kv, holder=hit[0]["holder"], holders=[{k: v for k, v in h.items() if k != "bytes"}
                                                               for h in hit])


def _span(ns: list[int]) -> str:
    return f"{ns[0]}-{ns[-1]}" if len(ns) > 1 else str(ns[0])
