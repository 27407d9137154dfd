"""The reproducer of a failing path case (``kvdiag.proof``): a path that ran in an engine of its own, held to its
reference case, on an engine that says how it was started (``protocol.Replayable``; vLLM). The script starts both
engines as kvdiag did and runs the prompts in the batch layouts kvdiag compared: all the prompts in one batch, and
for a path every run takes (``Path.own_floor``) all but one and one."""

from __future__ import annotations

from kvdiag.checks.paths.layouts import NAMES


def script(case, run) -> str | None:
    """The script's text, or None where this case has none (it passed, judged in its own engine, or its engine
    records no start)."""
    from kvdiag.checks.paths.catalogue import PATHS
    from kvdiag.checks.paths.params import PathsParams
    from kvdiag.proof.fill import filled

    m = case.metrics
    if case.status != "fail" or m.get("role") != "path" or not m.get("replay"):
        return None
    path = PATHS[m["path"]]
    ref = next((c for c in run.cases if c.metrics.get("role") == "reference" and c.metrics.get("path") ==
                path.reference and (c.engine, c.model, c.kv_dtype) == (case.engine, case.model, case.kv_dtype)), None)
    if ref is None or not ref.metrics.get("replay") or m["replay"].get("engine") != "vllm":
        return None
    prompts, max_tokens = m["prompts"], PathsParams.from_case(case).max_tokens
    return filled("vllm_paths_script.py", {
        "title": f"{case.id}: {path.summary}",
        "kvdiag_saw": "; ".join(f.message for f in case.findings if f.severity == "error"),
        "tolerance": m["tolerance"], "logprobs": 2,
        "engines": {"reference": ref.metrics["replay"], "path": {**m["replay"], "store_first": path.name == "offload"}},
        "batches": batches(prompts, max_tokens, path.own_floor and "all_but_one" in (m.get("layouts") or {}))})


def batches(prompts: list[list[int]], max_tokens: int, all_but_one: bool) -> list[dict]:
    """The generate calls, each labelled per request as kvdiag's findings name them (``layouts.pair``)."""
    from kvdiag.checks.paths.workload import reordered

    out = [{"prompts": prompts, "labels": [str(i) for i in range(len(prompts))], "max_tokens": max_tokens}]
    if all_but_one:
        out += [{"prompts": batch, "labels": [f"{i} {NAMES['all_but_one']}" for i in ix], "max_tokens": max_tokens}
                for ix, batch in reordered(prompts, "all_but_one")]
    return out
