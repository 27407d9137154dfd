"""The reproducer of a memleak case failed on what survives shutdown (``kvdiag.proof``), on an engine that says how
it was started (``protocol.Replayable``; vLLM, or the builtin engine through its public API): in a fresh process, a
baseline of the live tensors and CUDA's allocated bytes, then each cycle as kvdiag ran it (the engine with kvdiag's
arguments, the prompts, the shutdown as kvdiag does it) and a census of what survived, held to what kvdiag saw: the
KV cache by identity, survivors shaped by the cache, surviving bytes as large as kvdiag's finding, survivors that grow
every cycle, CUDA memory kept: all the cycles for a growth, else up to the first cycle a finding names (one engine
start, mostly). A case whose engine could not start again has the engine's own command (``proof/crash.py``); one
failed only on what the script does not measure (the driver's or RSS's views) has none."""

from __future__ import annotations

# the findings the script shows, and what each expects of it
KINDS = ("kv_cache_survived", "kv_shaped_survived", "kv_scaled_survived", "kv_proportional", "tensor_survived",
         "retained", "growth", "gc_frozen", "engine_process_alive")
EXACT = ("tensor_bytes", "cuda_allocated", "cuda_reserved")  # the retention and growth measures it reads
ENGINES = ("vllm", "builtin")  # the engines memleak_script.py starts (its "# only: ENGINE" lines)


def script(case, run=None) -> str | None:
    """The script's text, or None where this case has none (it passed, its engine records no start, or it failed
    only where the script does not look)."""
    from kvdiag.proof.fill import filled

    m = case.metrics
    errors = [f for f in case.findings if f.severity == "error"]
    if case.status != "fail" or (m.get("replay") or {}).get("engine") not in ENGINES or not m.get("prompt_ids") or \
            any(f.evidence.get("reproduce") for f in errors):  # a restart that failed: its own command
        return None
    expect = expected(errors, m.get("replay_kv_geometry"), m.get("children_exit_s"))
    if not any(v for k, v in expect.items() if k != "geometry"):
        return None
    first, starts = m["replay"].get("llm", m["replay"].get("spec")), m["replay_cycles"]  # each start's arguments
    if not expect.get("grows"):  # up to the first cycle a finding names: one engine start where that is the first
        starts = starts[:max(1, min((f.evidence["cycle"] for f in errors if isinstance(f.evidence.get("cycle"), int)),
                                    default=1))]
    return filled("memleak_script.py", {
        "title": f"{case.id}: what survives {len(starts)} engine shutdown(s)",
        "kvdiag_saw": "; ".join(f.message for f in errors), "engine": m["replay"], "prompts": m["prompt_ids"],
        "max_tokens": m["max_tokens"],
        "cycles": [{k: v for k, v in llm.items() if first.get(k) != v} for llm in starts],
        "expect": expect}, engine=m["replay"]["engine"])


def expected(errors: list, geometry: dict | None, wait_s: float | None = None) -> dict:
    """What the script holds its census to, from kvdiag's error findings: ``kv_cache`` (the cache by identity),
    ``kv_shaped``, ``bytes`` (the least surviving bytes a finding named), ``grows`` (the survivors' bytes per cycle,
    where they grew every cycle), ``cuda_allocated`` (bytes CUDA kept), ``frozen`` (objects gc.freeze() kept),
    ``processes`` (those alive after shutdown, waited for ``processes_wait_s``: the engine's ``children_exit_s``),
    and the cache's ``geometry``."""
    from kvdiag.measure.memory import MiB

    out: dict = {"geometry": geometry}
    sizes = []
    for f in errors:
        e = f.evidence
        if f.kind == "kv_cache_survived":
            out["kv_cache"] = True
        elif f.kind == "kv_shaped_survived":
            out["kv_shaped"] = True
        elif f.kind == "kv_scaled_survived" and e.get("mib"):
            sizes.append(e["mib"])
        elif f.kind == "kv_proportional" and e.get("holders"):
            sizes.append(min(min(h["mib"]) for h in e["holders"]))
        elif f.kind == "tensor_survived" and e.get("per_cycle_mib"):
            out["grows"] = [round(x * MiB) for x in e["per_cycle_mib"]]
        elif f.kind == "growth" and e.get("metric") in EXACT:
            out["grows"] = out.get("grows") or [0, round(sum(e["growth_mib"]) * MiB)]
        elif f.kind == "retained":
            mib = e.get("mib") or {}
            if mib.get("tensor_bytes"):
                sizes.append(mib["tensor_bytes"])
            if mib.get("cuda_allocated"):
                out["cuda_allocated"] = round(mib["cuda_allocated"] * MiB)
        elif f.kind == "gc_frozen" and e.get("frozen"):
            out["frozen"] = e["frozen"][-1] - (e.get("baseline") or 0)
        elif f.kind == "engine_process_alive" and e.get("processes"):
            out["processes"], out["processes_wait_s"] = len(e["processes"]), wait_s or 0
    if sizes:
        out["bytes"] = round(min(sizes) * MiB)
    return out
