"""The reproducer of a failing wake-cycle case (``kvdiag.proof``; a crashed one too, whose worker a wake killed after
it kept its start), on an engine that says how it was started
(``protocol.Replayable``; vLLM, whose sleep mode runs on CUDA and ROCm): one engine with kvdiag's arguments (sleep mode
on) runs the prompts, then, up to the cycle kvdiag first failed in, zeroes the free blocks, sleeps at the case's
level, wakes as vLLM documents it (level 2: the weights, ``reload_weights``, then the KV cache) and runs the prompts
again; each run after a wake is held to the first, and, where the case failed on memory, each sleep's freed bytes to
those kvdiag expected."""

from __future__ import annotations

MEMORY = ("not_freed", "not_restored")  # the findings judged on memory: the script measures it then


def script(case, run=None) -> str | None:
    """The script's text, or None where this case has none (it passed, or its engine records no start)."""
    from kvdiag.checks.kv_tensors import fill_numbers
    from kvdiag.checks.wake_cycle.params import WakeParams
    from kvdiag.checks.wake_cycle.run import FREED_MIN, RESTORE_TOL
    from kvdiag.proof.fill import filled

    m = case.metrics
    errors = [f for f in case.findings if f.severity == "error"]
    if case.status not in ("fail", "crashed") or not errors or (m.get("replay") or {}).get("engine") != "vllm":
        return None
    p = WakeParams.from_case(case)
    cycles = min(min(f.evidence.get("cycles") or [f.evidence.get("cycle") or p.cycles]) for f in errors)
    judged = bool({f.kind for f in errors} & set(MEMORY)) and m.get("expected_bytes")
    generate = {"do": "generate", "prompts": "prompts", "max_tokens": m["max_tokens"]}
    steps = [{**generate, "as": "reference", "what": "the reference run"}]
    for n in range(1, cycles + 1):
        steps += [{"do": "fill", "value": "zero", "optional": True, "what": f"cycle {n}: zero the free blocks"}]
        steps += [{"do": "memory", "as": f"before {n}"}] if judged else []
        steps += [{"do": "sleep", "level": p.level, "what": f"cycle {n}: sleep at level {p.level}"}]
        steps += [{"do": "memory", "as": f"asleep {n}"}] if judged else []
        steps += [{**s, "what": f"cycle {n}: {s['do']}"} for s in wake_steps(p.level, p.staged)]
        steps += [{"do": "memory", "as": f"awake {n}"}] if judged else []
        steps += [{**generate, "as": f"cycle {n}", "what": f"cycle {n}: the run after the wake"}]
    return filled("vllm_greedy_script.py", {
        "title": f"{case.id}: the outputs after a level-{p.level} sleep and wake" + (" (staged)" if p.staged else ""),
        "kvdiag_saw": "; ".join(f.message for f in errors), "tolerance": p.logprob_tol, "engine": m["replay"],
        "inputs": {"prompts": m["prompt_ids"]}, "steps": steps,
        "compare": [["reference", f"cycle {n}"] for n in range(1, cycles + 1)],
        "memory": {"cycles": list(range(1, cycles + 1)), "expected_bytes": m["expected_bytes"],
                   "freed_min": FREED_MIN, "restore_tol": RESTORE_TOL} if judged else None,
        "fill": {"zero": fill_numbers("zero", case.kv_dtype)}})


def wake_steps(level: int, staged: bool) -> list[dict]:
    """vLLM's documented wake after a sleep at ``level`` (kvdiag's ``engines/vllm/sleep.py``): level 1 all tags at
    once, or ``weights`` then ``kv_cache``; level 2 the weights, their reload from the checkpoint, then the cache."""
    if level == 1 and not staged:
        return [{"do": "wake", "tags": None}]
    reload = [{"do": "reload_weights"}] if level == 2 else []
    return [{"do": "wake", "tags": ["weights"]}, *reload, {"do": "wake", "tags": ["kv_cache"]}]
