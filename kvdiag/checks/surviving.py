"""memleak's finding on tensors that survive shutdown (docs/DESIGN.md, "memleak"): those the census sees after a
shutdown that the baseline did not have, with the holder :mod:`kvdiag.memory_holders` names. A set whose count or
bytes grow every cycle fails; the same small set every cycle is a warning (a process-lifetime cache).
"""

from __future__ import annotations

from kvdiag.memory import MiB, to_mib


def findings(rec, cycles: list, retain: float) -> None:
    """Tensors that survive shutdown: an error when their count or bytes grow every cycle, else a warning."""
    last = next((c for c in reversed(cycles) if c.holders), None)
    if last is None:
        return
    counts = [c.survivors.count + c.survivors.small_count for c in cycles]
    sizes = [c.survivors.bytes + c.survivors.small_bytes for c in cycles]
    grows = len(cycles) > 1 and any(all(b > a for a, b in zip(v, v[1:])) for v in (counts, sizes))
    per_cycle = [to_mib(c.survivors.bytes) for c in cycles]
    if grows:
        severity, why = "error", (f"they grow every cycle: {' → '.join(map(str, counts))} tensors, "
                                  f"{' → '.join(f'{x / MiB:.3g}' for x in sizes)} MiB")
    elif len(cycles) > 1:
        severity, why = "warning", (f"the same every cycle and under the retention limit of {retain / MiB:.0f} "
                                    "MiB: a process-lifetime cache, not a growing leak")
    else:
        severity, why = "warning", (f"one cycle: growth not measured; under the retention limit of "
                                    f"{retain / MiB:.0f} MiB")
    for h in last.holders:
        rec.add(severity, "tensor_survived", f"{to_mib(h.bytes):.3g} MiB in {h.tensors} tensor(s) "
                f"({h.count} storages) survive shutdown, held by {h.holder}; {why}", **h.to_json(),
                per_cycle_mib=per_cycle, devices=last.survivors.by_device)
