"""The reproducer of a failing wake-cycle case (``kvdiag.proof``; a crashed one too, whose worker a wake killed after
it kept its start), on an engine that says how it was started
(``protocol.Replayable``; vLLM, whose sleep mode runs on CUDA and ROCm, or the builtin engine through its public API):
one engine with kvdiag's arguments (sleep mode on) runs the prompts, then, up to the cycle kvdiag first failed in,
zeroes the free blocks, sleeps at the case's level, wakes as kvdiag woke it (vLLM: as vLLM documents it, level 2: the
weights, ``reload_weights``, then the KV cache) and runs the prompts again; each run after a wake is held to the
first, and, where the case failed on memory, each sleep's freed bytes to those kvdiag expected (CUDA's driver view:
on the CPU the script leaves memory out and shows the outputs, and a case failed on memory alone has no script)."""

from __future__ import annotations

MEMORY = ("not_freed", "not_restored")  # the findings judged on memory: the script measures it then
ENGINES = ("vllm", "builtin")  # the engines greedy_script.py starts (its "# only: ENGINE" lines)


def script(case, run=None) -> str | None:
    """The script's text, or None where this case has none (it passed, or its engine records no start)."""
    from kvdiag.checks.kv_tensors import fill_numbers
    from kvdiag.checks.wake_cycle.params import WakeParams
    from kvdiag.checks.wake_cycle.run import FREED_MIN, RESTORE_TOL
    from kvdiag.proof.fill import filled

    m = case.metrics
    errors = [f for f in case.findings if f.severity == "error"]
    engine = (m.get("replay") or {}).get("engine")
    if case.status not in ("fail", "crashed") or not errors or engine not in ENGINES:
        return None
    p = WakeParams.from_case(case)
    cycles = min(min(f.evidence.get("cycles") or [f.evidence.get("cycle") or p.cycles]) for f in errors)
    kinds = {f.kind for f in errors}
    judged = bool(kinds & set(MEMORY)) and m.get("expected_bytes")
    on_cpu = judged and m.get("device") == "cpu"  # the script measures memory as CUDA's driver sees it: none there
    if on_cpu and kinds <= set(MEMORY):
        return None
    judged = judged and not on_cpu
    generate = {"do": "generate", "prompts": "prompts", "max_tokens": m["max_tokens"]}
    steps = [{**generate, "as": "reference", "what": "the reference run"}]
    for n in range(1, cycles + 1):
        steps += [{"do": "fill", "value": "zero", "optional": True, "what": f"cycle {n}: zero the free blocks"}]
        steps += [{"do": "memory", "as": f"before {n}"}] if judged else []
        steps += [{"do": "sleep", "level": p.level, "what": f"cycle {n}: sleep at level {p.level}"}]
        steps += [{"do": "memory", "as": f"asleep {n}"}] if judged else []
        steps += [{**s, "what": f"cycle {n}: {s['do']}"} for s in wake_steps(p.level, p.staged, engine)]
        steps += [{"do": "memory", "as": f"awake {n}"}] if judged else []
        steps += [{**generate, "as": f"cycle {n}", "what": f"cycle {n}: the run after the wake"}]
    note = "Memory is left out: kvdiag measured it on the CPU, the script as CUDA's driver sees it." if on_cpu else None
    return filled("greedy_script.py", note=note, case={
        "title": f"{case.id}: the outputs after a level-{p.level} sleep and wake" + (" (staged)" if p.staged else ""),
        "kvdiag_saw": "; ".join(f.message for f in errors), "tolerance": p.logprob_tol, "engine": m["replay"],
        "inputs": {"prompts": m["prompt_ids"]}, "steps": steps,
        "compare": [["reference", f"cycle {n}"] for n in range(1, cycles + 1)],
        "memory": {"cycles": list(range(1, cycles + 1)), "expected_bytes": m["expected_bytes"],
                   "freed_min": FREED_MIN, "restore_tol": RESTORE_TOL} if judged else None,
        "fill": {"zero": fill_numbers("zero", case.kv_dtype)}}, engine=engine)


def wake_steps(level: int, staged: bool, engine: str = "vllm") -> list[dict]:
    """The wake after a sleep at ``level`` as kvdiag does it: all tags at once, or ``weights`` then ``kv_cache``
    (``staged``; the builtin engine reads its weights again itself); vLLM's level 2 as vLLM documents it (kvdiag's
    ``engines/vllm/sleep.py``): the weights, their reload from the checkpoint, then the cache."""
    if (level == 1 or engine != "vllm") and not staged:
        return [{"do": "wake", "tags": None}]
    if engine != "vllm":
        return [{"do": "wake", "tags": ["weights"]}, {"do": "wake", "tags": ["kv_cache"]}]
    reload = [{"do": "reload_weights"}] if level == 2 else []
    return [{"do": "wake", "tags": ["weights"]}, *reload, {"do": "wake", "tags": ["kv_cache"]}]
