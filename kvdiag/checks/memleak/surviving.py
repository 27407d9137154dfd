"""memleak's finding on tensors that survive shutdown (docs/DESIGN.md, "memleak"): those the census sees after a
shutdown that the baseline did not have, with the holder :mod:`kvdiag.measure.holders` names. A set whose count or
bytes grow every cycle fails; the same small set every cycle is a warning (a process-lifetime cache).
"""

from __future__ import annotations

from kvdiag.checks.memleak import kv_ratio
from kvdiag.measure.memory import MiB, to_mib


def findings(rec, cycles: list, retain: float) -> None:
    """Tensors that survive shutdown, one finding per holder, each judged on its own numbers across the cycles: an
    error when that holder's tensors or bytes grow every cycle, else a warning (a holder that stays the same while
    another one leaks keeps its warning and its own numbers). When the survivors grow every cycle but no single
    holder does (new holders each cycle), the holders that changed share the error, with the totals."""
    last = next((c for c in reversed(cycles) if c.holders), None)
    if last is None:
        return
    counts = [c.survivors.count + c.survivors.small_count for c in cycles]
    sizes = [c.survivors.bytes + c.survivors.small_bytes for c in cycles]
    phase = kv_ratio.phases(cycles)
    totals_grow = _grows(counts, phase) or _grows(sizes, phase)
    kv_sized = _kv_sized(cycles)
    for h in last.holders:
        tensors, nbytes = _own(cycles, h.holder)
        if _grows(tensors, phase) or _grows(nbytes, phase):
            severity, why = "error", f"it grows every cycle: {_path(tensors)} tensors, {_path(nbytes, MiB)} MiB"
        elif totals_grow and (len(set(tensors)) > 1 or len(set(nbytes)) > 1):
            severity, why = "error", (f"the survivors grow every cycle ({_path(counts)} tensors, {_path(sizes, MiB)} "
                                      f"MiB in all) and this holder's changed: {_path(nbytes, MiB)} MiB")
        elif h.holder in kv_sized:
            severity, why = "warning", f"sized by the KV cache, not a process-lifetime cache: {kv_sized[h.holder]} " \
                "judges it"
        else:
            severity, why = "warning", _constant(h.bytes, retain, len(cycles))
        rec.add(severity, "tensor_survived", f"{to_mib(h.bytes):.3g} MiB in {h.tensors} tensor(s) "
                f"({h.count} storages) survive shutdown, held by {h.holder}; {why}", **h.to_json(),
                per_cycle_mib=[round(b / MiB, 3) for b in nbytes], per_cycle_tensors=tensors,
                devices=last.survivors.by_device)


def _constant(nbytes: int, retain: float, cycles: int) -> str:
    """Why a survivor that did not grow is a warning, in true numbers: under the retention limit or not (over it,
    the retention finding fails the case on the same bytes)."""
    limit = f"the retention limit of {retain / MiB:.0f} MiB"
    where = f"under {limit}" if nbytes <= retain else f"over {limit} (the retention finding judges it)"
    if cycles > 1:
        return f"the same every cycle and {where}: a process-lifetime cache, not a growing leak"
    return f"one cycle: growth not measured; {where}"


def _own(cycles: list, holder: str) -> tuple[list[int], list[int]]:
    """(tensors, bytes) of one holder after each cycle's shutdown (0 where it held nothing)."""
    rows = [next((h for h in c.holders if h.holder == holder), None) for c in cycles]
    return [h.tensors if h else 0 for h in rows], [h.bytes if h else 0 for h in rows]


def _kv_sized(cycles: list) -> dict[str, str]:
    """Holder -> the finding that judges it as sized by the KV cache (kv_scaled, kv_shape, kv_ratio)."""
    constant = kv_ratio.constant(cycles)
    out = {h.holder: "kv_shaped_survived" for c in cycles for h in c.kv_shaped if h.holder not in constant}
    out.update({h.holder: "kv_scaled_survived" for c in cycles for h in c.kv_scaled if h.holder not in constant})
    cmp = kv_ratio.compare(cycles)
    out.update({h["holder"]: "kv_proportional" for h in (cmp or {}).get("holders", ())
                if h["verdict"] == "proportional"})
    return out


def _grows(v: list, phase: list | None = None) -> bool:
    """Whether ``v`` (one value per cycle) grows in every step that stays at one KV size (``phase``: each cycle's;
    None: one size), with at least one such step."""
    phase = phase or [None] * len(v)
    steps = [(a, b) for i, (a, b) in enumerate(zip(v, v[1:])) if phase[i] == phase[i + 1]]
    return bool(steps) and all(b > a for a, b in steps)


def _path(v: list, unit: int = 1) -> str:
    return " → ".join(f"{x / unit:.3g}" if unit > 1 else str(x) for x in v)
