"""The reproducer of a failing path case (``kvdiag.proof``), on an engine that says how it was started
(``protocol.Replayable``): vLLM, through ``vllm.LLM``, or the builtin engine, through its public API
(``kvdiag.engines.builtin``). A path held to its reference case runs in two engines, as kvdiag ran it: the
reference's and the path's (kv-connector's twice, in processes of their own: the first stores, the second loads),
each calling the prompts in the batch layouts kvdiag compared (all the prompts in one batch; for a path every run
takes, ``Path.own_floor``, also all but one, then one). A prefix-cache path runs in one engine: its cold run, then
the path's calls in the same engine; the sliding window too: the decode past the window, then a prefill at each cut
past it, held to the decode's token there. A case whose engine crashed in a generate call (``died_on``): the engine
started as kvdiag started it and that call (``call_script.py``), which must raise what kvdiag saw, or, where
kvdiag's worker died in it (the call kept before it was made), kill the script's engine process."""

from __future__ import annotations

from kvdiag.checks.paths.layouts import NAMES

ENGINES = ("vllm", "builtin")  # the engines paths_script.py starts (its "# only: ENGINE" lines)


def script(case, run) -> str | None:
    """The script's text, or None where this case has none (it passed, or its engine records no start)."""
    from kvdiag.checks.paths.catalogue import PATHS
    from kvdiag.checks.paths.params import PathsParams
    from kvdiag.proof.fill import filled

    m = case.metrics
    if case.status == "crashed" and m.get("died_on") and (m.get("replay") or {}).get("engine") in ENGINES:
        return crashed(case)
    if case.status != "fail" or not m.get("replay") or m["replay"].get("engine") not in ENGINES:
        return None
    path, max_tokens = PATHS[m["path"]], PathsParams.from_case(case).max_tokens
    share = None
    if m.get("role") == "own" and path.name in OWN:
        steps = OWN[path.name](m, max_tokens)
        if path.name == WINDOW and not any(f.severity == "error" and ALONE not in f.message for f in case.findings):
            # failed only on the batch against each prompt alone: that comparison, judged as kvdiag judged it
            steps, share = _alone(m), _share(m[ALONE], PathsParams.from_case(case).floor_factor)
        engines, runs = {"path": m["replay"]}, [{"engine": "path", "steps": steps}]
    elif m.get("role") == "path":
        ref = next((c for c in run.cases if c.metrics.get("role") == "reference" and c.metrics.get("path") ==
                    path.reference and (c.engine, c.model, c.kv_dtype) == (case.engine, case.model, case.kv_dtype)),
                   None)
        if ref is None or not ref.metrics.get("replay"):
            return None
        calls = batches(m["prompts"], max_tokens, path.own_floor and "all_but_one" in (m.get("layouts") or {}))
        engines = {"reference": ref.metrics["replay"], "path": m["replay"]}
        runs = [{"engine": "reference", "steps": [{**c, "reset": True, "as": "reference"} for c in calls]},
                *path_runs(path.name, calls, m["replay"])]
    else:
        return None
    return filled("paths_script.py", {
        "title": f"{case.id}: {path.summary}",
        "kvdiag_saw": "; ".join(f.message for f in case.findings if f.severity == "error"),
        "tolerance": m[ALONE]["tolerance"] if share else m["tolerance"], "share": share, "logprobs": 2,
        "batch_invariance": batch_invariance(case), "engines": engines, "runs": runs}, engine=m["replay"]["engine"])


def crashed(case) -> str:
    """The engine's start and the generate call that raised in kvdiag, in a fresh process, and, where it alone does
    not raise, after the calls kvdiag made before it in that engine (``call_script.py``)."""
    from kvdiag.proof.fill import filled

    died = case.metrics["died_on"]
    call = {k: died[k] for k in ("prompts", "max_tokens", "logprobs")}
    how = "raised in" if died.get("raised") else "died in"  # no exception: kvdiag's worker died in the call
    return filled("call_script.py", {
        "title": f"{case.id}: the engine {how} a generate call ({died['what']})",
        "kvdiag_saw": "; ".join(f.message for f in case.findings if f.severity == "error"),
        "expected": f"the call completes: {len(call['prompts'])} prompt(s), {call['max_tokens']} greedy tokens each",
        "raises": died.get("raised"), "engine": case.metrics["replay"], "calls": [call],
        "before": died.get("before") or []},
        engine=case.metrics["replay"]["engine"])


def batch_invariance(case) -> dict | None:
    """The environment ``--batch-invariant`` set before the case's engines started (the engine's traits'), which the
    script sets in its own environment before vLLM is imported; None without it."""
    from kvdiag.checks.paths.params import PathsParams
    from kvdiag.engines.base import engine_traits

    if not PathsParams.from_case(case).batch_invariant:
        return None
    env = engine_traits(case.engine).batch_invariance("cuda")  # it is taken only on a GPU: the case ran on one
    return env if isinstance(env, dict) else None


def batches(prompts: list[list[int]], max_tokens: int, all_but_one: bool) -> list[dict]:
    """The generate calls, each labelled per request as kvdiag's findings name them (``layouts.pair``)."""
    from kvdiag.checks.paths.workload import reordered

    out = [{"prompts": prompts, "labels": [str(i) for i in range(len(prompts))], "max_tokens": max_tokens}]
    if all_but_one:
        out += [{"prompts": batch, "labels": [f"{i} {NAMES['all_but_one']}" for i in ix], "max_tokens": max_tokens}
                for ix, batch in reordered(prompts, "all_but_one")]
    return out


def path_runs(name: str, calls: list[dict], replay: dict) -> list[dict]:
    """The path engine's runs, each in a fresh process: one, but for kv-connector two, as kvdiag ran it (``run.py``,
    ``connector.py``): the first stores the prompts through the connector (its directory emptied first), the second
    loads them (and removes the directory)."""
    if name != "kv-connector":
        return [{"engine": "path", "steps": [s for c in calls for s in path_steps(name, c)]}]
    if replay["engine"] == "builtin":  # -a kv_connector_dir (the builtin engine's connector.py)
        store = replay["spec"]["engine_args"]["kv_connector_dir"]
    else:
        store = replay["llm"]["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"]
    return [{"engine": "path", "empty_dir": store, "steps": [{**c, "reset": True, "as": None} for c in calls]},
            {"engine": "path", "drop_dir": store, "steps": [{**c, "reset": True, "as": "path"} for c in calls]}]


def path_steps(name: str, call: dict) -> list[dict]:
    """The path engine's steps for one call: offload first stores the batch, drops the device's prefix cache and
    runs it again (what it then reads as cached came from CPU memory, ``run._offload``)."""
    if name == "offload":
        return [{**call, "reset": True, "as": None}, {**call, "reset": True, "as": "path"}]
    return [{**call, "reset": True, "as": "path"}]


def _hit(m: dict, max_tokens: int) -> list[dict]:
    (call,) = batches(m["prompts"], max_tokens, False)
    return [{**call, "reset": True, "as": "reference"}, {**call, "reset": False, "as": "path"}]


def _reset(m: dict, max_tokens: int) -> list[dict]:
    (call,) = batches(m["prompts"], max_tokens, False)
    return [{**call, "reset": True, "as": "reference"}, {**call, "reset": True, "as": "path"}]


def _partial(m: dict, max_tokens: int) -> list[dict]:
    """As ``run._partial``: the partial prompts cold, then the cached prompts, then the partial prompts again."""
    from kvdiag.checks.paths.workload import partial_prompts

    (other,) = batches(partial_prompts(m["prompts"], m["block_size"]), max_tokens, False)
    (cached,) = batches(m["prompts"], max_tokens, False)
    return [{**other, "reset": True, "as": "reference"}, {**cached, "reset": True, "as": None},
            {**other, "reset": False, "as": "path"}]


def _evicted(m: dict, max_tokens: int) -> list[dict]:
    """As ``run._evicted``, in the pool the engine was started with: the prompts (cached), the prompts that evict
    part of their blocks, then the prompts again, last first (their labels say which request each is)."""
    from kvdiag.checks.paths.workload import after_eviction, evicting_prompts

    (cached,) = batches(m["prompts"], max_tokens, False)
    (other,) = batches(evicting_prompts(m["prompts"], m["block_size"], max_tokens), max_tokens, False)
    order = after_eviction(len(m["prompts"]))
    again = {"prompts": [m["prompts"][i] for i in order], "labels": [str(i) for i in order],
             "max_tokens": max_tokens}
    return [{**cached, "reset": True, "as": "reference"}, {**other, "reset": False, "as": None},
            {**again, "reset": False, "as": "path"}]


def _window(m: dict, max_tokens: int) -> list[dict]:
    """As ``sliding.serve``: the prompts decoded past the window in one batch (after an emptied prefix cache), then
    each (prompt, cut) past the window prefilled for one token, its prompt and the decode's tokens up to the cut: the
    decode's token at the cut is the reference, the prefill's the path."""
    labels = [str(i) for i in range(len(m["prompts"]))]
    return [{"prompts": m["prompts"], "labels": labels, "max_tokens": m["generated"], "reset": True, "as": None,
             "keep": "decode"},
            {"prompts": m["prompts"], "labels": [f"{i} at {k}" for i, k in m["cuts"]], "cuts": m["cuts"],
             "from": "decode", "max_tokens": 1, "reset": False, "as": "path"}]


def _alone(m: dict) -> list[dict]:
    """As ``sliding.serve`` and ``sliding.against_alone``: the decode past the window in one batch, the prefills at
    its cuts (the engine's state as kvdiag left it), then each prompt decoded alone; the batch's completions are the
    path, each prompt's alone the reference, both past the positions whose context fits the window (``past``)."""
    from kvdiag.checks.paths.sliding import inside_window

    n = len(m["prompts"])
    past = {str(i): k for i, k in enumerate(inside_window(m["prompts"], m["window"]))}
    cuts = [list(c) for c in m["inside_cuts"] + m["cuts"]]
    return [{"prompts": m["prompts"], "labels": [str(i) for i in range(n)], "max_tokens": m["generated"],
             "reset": True, "as": "path", "keep": "decode", "past": past},
            {"prompts": m["prompts"], "labels": [f"{i} at {k}" for i, k in cuts], "cuts": cuts, "from": "decode",
             "max_tokens": 1, "reset": False, "as": None},
            *({"prompts": [q], "labels": [str(i)], "max_tokens": m["generated"], "reset": False, "as": "reference",
               "past": {str(i): past[str(i)]}} for i, q in enumerate(m["prompts"]))]


def _share(judged: dict, factor: float) -> dict:
    """The share rule kvdiag held the batch against each prompt alone to (``floor.judge`` with ``share_of``)."""
    from kvdiag.checks.paths.floor import MOVED_BY, allowed_share

    return {"moved_by": MOVED_BY, "allowed": allowed_share(judged["floor"].get("moved_share", 0.0), factor)}


PREFIX = {"prefix-hit": _hit, "prefix-reset": _reset, "prefix-partial": _partial, "prefix-evicted": _evicted}
WINDOW, ALONE = "sliding-window", "the batch against each prompt alone"  # sliding.PATH, sliding.ALONE
OWN = {**PREFIX, WINDOW: _window}  # the paths judged in their own engine that a script replays
