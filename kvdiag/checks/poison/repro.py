"""The reproducer of a failing poison case (``kvdiag.proof``), on an engine that says how it was started
(``protocol.Replayable``; vLLM with its engine core in the script's process, as kvdiag runs it, or the builtin engine
through its public API): one engine with kvdiag's arguments (the small cache, prefix caching off) runs the waves
twice, first with the free blocks zeroed before each wave, then filled with the case's poison, and holds the poisoned
run's outputs to the zeroed run's. The blocks are read from the engine (vLLM's own block pool, the builtin engine's
``kv_blocks`` view) and filled in its cache tensors, whole blocks, by the script itself. A case that
failed on what its written KV slots hold (``nan_kv``) also has each poisoned wave's written slots scanned: those whose
bytes changed since the fill, holding NaN/Inf (its scale tensors are not judged); one failed on them alone runs the
poisoned waves only."""

from __future__ import annotations

OUTPUTS = ("divergence", "logprob_drift", "nan_output")  # the findings the script's outputs show
ENGINES = ("vllm", "builtin")  # the engines greedy_script.py starts (its "# only: ENGINE" lines)


def script(case, run=None) -> str | None:
    """The script's text, or None where this case has none (it passed, failed on nothing the script sees, or its
    engine records no start)."""
    from kvdiag.checks.kv_tensors import fill_numbers
    from kvdiag.checks.poison.params import PoisonParams
    from kvdiag.proof.fill import filled

    m = case.metrics
    errors = [f for f in case.findings if f.severity == "error"]
    kinds = {f.kind for f in errors}
    outputs, slots = bool(kinds & set(OUTPUTS)), "nan_kv" in kinds
    if case.status != "fail" or not (outputs or slots) or (m.get("replay") or {}).get("engine") not in ENGINES or \
            not m.get("waves"):
        return None
    p = PoisonParams.from_case(case)
    steps = []
    for fill, label in ((("zero", "zeroed"),) if outputs else ()) + ((p.value, "poisoned"),):
        scan = slots and label == "poisoned"
        for n, wave in enumerate(m["waves"], 1):
            steps += [{"do": "fill", "value": fill, "seed": p.seed + n - 1, **({"snapshot": True} if scan else {}),
                       "what": f"wave {n}: the free blocks filled with {fill}"},
                      {"do": "generate", "prompts": f"wave {n}", "max_tokens": wave["max_tokens"],
                       "as": f"{label} wave {n}", "what": f"wave {n} ({label})"}]
            steps += [{"do": "scan", "as": f"scan wave {n}", "what": f"wave {n}: the KV slots it wrote"}] if scan \
                else []
    what = " and ".join(w for w, on in (("the outputs", outputs), ("the KV slots each wave wrote", slots)) if on)
    start = m["replay"].get("llm", m["replay"].get("spec")) or {}  # the engine's own arguments: its kv dtype's name
    return filled("greedy_script.py", {
        "title": f"{case.id}: {what} with the free KV blocks poisoned ({p.value})" + (" against zeroed" if outputs
                                                                                     else ""),
        "kvdiag_saw": "; ".join(f.message for f in errors), "tolerance": p.logprob_tol, "engine": m["replay"],
        "inputs": {f"wave {n}": wave["prompts"] for n, wave in enumerate(m["waves"], 1)}, "steps": steps,
        "compare": [[f"zeroed wave {n}", f"poisoned wave {n}"] for n in range(1, len(m["waves"]) + 1)] if outputs
        else [], "memory": None,
        "fill": {v: fill_numbers(v, case.kv_dtype) for v in {"zero", p.value} - {"random"}},
        "kv_cache_dtype": str(start.get("kv_cache_dtype"))}, engine=m["replay"]["engine"])
