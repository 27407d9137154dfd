"""The reproducer of a failing poison case (``kvdiag.proof``), on an engine that says how it was started
(``protocol.Replayable``; vLLM with its engine core in the script's process, as kvdiag runs it): one engine with
kvdiag's arguments (the small cache, prefix caching off) runs the waves twice, first with the free blocks zeroed before
each wave, then filled with the case's poison, and holds the poisoned run's outputs to the zeroed run's. The blocks
are read from vLLM's own block pool and filled in its cache tensors, whole blocks, by the script itself. A case that
failed only on what its written KV slots hold (``nan_kv``: kvdiag scans them through its view of the cache) has no
script: the plain script judges outputs."""

from __future__ import annotations

OUTPUTS = ("divergence", "logprob_drift", "nan_output")  # the findings the script's outputs show


def script(case, run=None) -> str | None:
    """The script's text, or None where this case has none (it passed, failed only on its KV slots, or its engine
    records no start)."""
    from kvdiag.checks.kv_tensors import fill_numbers
    from kvdiag.checks.poison.params import PoisonParams
    from kvdiag.proof.fill import filled

    m = case.metrics
    errors = [f for f in case.findings if f.severity == "error"]
    if case.status != "fail" or not any(f.kind in OUTPUTS for f in errors) or \
            (m.get("replay") or {}).get("engine") != "vllm" or not m.get("waves"):
        return None
    p = PoisonParams.from_case(case)
    steps = []
    for fill, label in (("zero", "zeroed"), (p.value, "poisoned")):
        for n, wave in enumerate(m["waves"], 1):
            steps += [{"do": "fill", "value": fill, "seed": p.seed + n - 1,
                       "what": f"wave {n}: the free blocks filled with {fill}"},
                      {"do": "generate", "prompts": f"wave {n}", "max_tokens": wave["max_tokens"],
                       "as": f"{label} wave {n}", "what": f"wave {n} ({label})"}]
    return filled("vllm_greedy_script.py", {
        "title": f"{case.id}: the outputs with the free KV blocks poisoned ({p.value}) against zeroed",
        "kvdiag_saw": "; ".join(f.message for f in errors), "tolerance": p.logprob_tol, "engine": m["replay"],
        "inputs": {f"wave {n}": wave["prompts"] for n, wave in enumerate(m["waves"], 1)}, "steps": steps,
        "compare": [[f"zeroed wave {n}", f"poisoned wave {n}"] for n in range(1, len(m["waves"]) + 1)],
        "memory": None, "fill": {v: fill_numbers(v, case.kv_dtype) for v in {"zero", p.value} - {"random"}}})
