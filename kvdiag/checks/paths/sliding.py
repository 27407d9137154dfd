"""The ``sliding-window`` path: a greedy generation that runs past a sliding layer's window, where the engine frees
the blocks behind the window during decode and hands them out again (vLLM #42273: a block table left stale after
the free; #49795: the window applied to every layer).

Truth: a prefill of the same tokens. Each prompt (cut to half a window, so that early cuts are inside it) is
generated greedily for two windows and a block; its completion is cut at positions past the window, and prompt +
completion[:k] is prefilled for one token, which must be decoded token k with its logprob: position by position,
one (prompt, cut) a request, so a difference does not cascade. The floor is the same decode-against-prefill at
cuts whose length stays inside the window (nothing freed yet), at the cuts past it with each prompt decoded alone
(no other request takes the blocks it frees), and the check's own floor runs (``engine_runs.floor_runs``) on
generations that stay inside the window: a batch run past it would take the path, and a fault's effect would
widen the floor that should expose it.

A second truth: each prompt decoded alone, at every position (``against_alone``). Both runs decode, so past the
window only the blocks other requests took tell them apart; judged by the share of positions that moved
(``floor.MOVED_SHARE``), since decode and prefill in bf16 differ by a whole logit step that hides a small fault.

The pool (``needs``): what the batch holds at its peak when the windows are honoured, and a block of slack, so that
the blocks freed behind a window are the ones the next allocations get. Pure here but for ``serve``: the unit tests
hold the sizes and cuts to an independent computation.
"""

from __future__ import annotations

from kvdiag.checks.paths.workload import blocks_for

PATH = "sliding-window"
NO_WINDOW = "no sliding-window layer in {model} (zoo:gemma3 has them): nothing decodes past a window"
SLACK_BLOCKS = 1  # over the windowed peak: freed blocks are reused at once, and no request is preempted


def need(model: str, prompts: int, block: int, device: str) -> dict | str:
    """The path's sizes (``needs``) from the window of ``model``'s layers; none slides: why it is unsupported."""
    from kvdiag.models import config, label, resolve, sliding_window

    cfg = config(resolve(model), text=True)
    window = sliding_window(cfg)
    if window is None:
        return NO_WINDOW.format(model=label(model))
    sizes = needs(prompts, window, block, device)
    longest = cfg.get("max_position_embeddings")
    if isinstance(longest, int) and longest < sizes["max_model_len"]:
        return (f"{label(model)} takes {longest} positions; two windows of {window} past the prompt need "
                f"{sizes['max_model_len']}")
    return sizes


def generated(window: int, block: int) -> int:
    """Tokens generated per prompt: two windows and a block past a prompt of at most half a window, so that the
    windows free at least two blocks of every request however the block and window compare (a block past one
    window and a half when blocks are the larger)."""
    return max(2 * window + block, window + 2 * block)


def truncate(prompts: list[list[int]], window: int) -> list[list[int]]:
    """Each prompt cut to at most half a window of tokens, so that cuts inside the window exist: 3, 2, 1, 0 tokens
    less in turn, so that each request of a four is one token ahead of the one before it. vLLM hands a freed block
    to the next allocation (LIFO); a request frees its block behind the window one step before its own next block:
    only a request one token ahead, scheduled after it, allocates in that step and gets the block, and only its
    writes land while the block is still the other's to read if the free was early (a stale or too eager free)."""
    return [list(p[:max(1, window // 2 - 3 + i % 4)]) for i, p in enumerate(prompts)]


def cuts(prompt_len: int, window: int, block: int, tokens: int, i: int = 0) -> tuple[list[int], list[int]]:
    """Generated positions k (prompt + completion[:k] prefilled, token k compared) of a prompt of ``prompt_len``:
    (inside, past). Inside: context lengths three quarters of a window and one short of it (nothing freed). Past:
    just after the first block behind the window was freed (``window + block``, shifted by the prompt's index so
    that the cuts fall at different offsets in a block), halfway to the end, and the last generated token."""
    last = prompt_len + tokens - 1  # the last decoded token's context length
    inside = {window - window // 4, window - 1}
    past = {min(window + block + i % max(1, block // 2), last), (window + block + last) // 2, last}

    def keep(lengths, lo, hi):  # context lengths -> the positions this completion has
        return sorted(n - prompt_len for n in lengths if lo <= n <= hi and 0 <= n - prompt_len < tokens)

    return keep(inside, prompt_len, window - 1), keep(past, window + 1, last)


def peak_blocks(length: int, window: int, block: int) -> int:
    """Blocks one request of ``length`` tokens holds at its peak: its full layers' every block, and its sliding
    layers' blocks from the window's first to the slot being computed (vLLM's ``SlidingWindowManager`` frees, before
    each step's allocation, the ``(computed - window + 1) // block`` blocks that lie wholly behind the window)."""
    sliding = max(blocks_for(c + 1, block) - max(0, c - window + 1) // block for c in range(length))
    return blocks_for(length, block) + sliding


def needs(prompts: int, window: int, block: int, device: str) -> dict:
    """The sizes of the path engine (``EngineTraits.path_config``), before any start: every prompt at its longest
    (half a window). ``window_blocks``: the pool, with vLLM's null block; ``max_model_len``: the longest request;
    ``batch_tokens``: a step that prefills every cut whole (a prefill chunked would free blocks between chunks)."""
    tokens = generated(window, block)
    length = window // 2 + tokens
    pool = prompts * peak_blocks(length, window, block) + SLACK_BLOCKS + 1
    return {"device": device, "block_size": block, "window": window, "tokens": tokens, "prompts": prompts,
            "window_blocks": pool, "max_model_len": blocks_for(length, block) * block,
            "batch_tokens": max(2048, blocks_for(length, block) * block)}


def serve(case, ctx, p, path, engine, prompts, spec, need, config, env):
    """Decode past the window, prefill at the cuts, judge (``verdict.verdict``)."""
    from dataclasses import replace

    from kvdiag.checks.common import replay_of
    from kvdiag.checks.paths.engine_runs import (
        Trial,
        block_size,
        counted_run,
        counter,
        floor_runs,
        generate,
        part,
        reset,
    )
    from kvdiag.checks.paths.floor import Floor, distance
    from kvdiag.checks.paths.verdict import judge_also, verdict

    window, tokens, block = need["window"], need["tokens"], block_size(engine, spec)
    prompts = truncate(prompts, window)
    ctx.stage(case, f"path {path.name}: decode past the window")
    reset(engine)
    preempted = counter(engine, "preemptions")
    decoded, counted = counted_run(engine, prompts, tokens, path.counter, "decode past the window")
    at = {"inside": [], "past": []}
    for i, (ids, c) in enumerate(zip(prompts, decoded)):
        inside, past = cuts(len(ids), window, block, len(c.token_ids), i)
        at["inside"] += [(i, k) for k in inside]
        at["past"] += [(i, k) for k in past]
    ctx.stage(case, f"path {path.name}: prefill at the cuts")
    pairs = at["inside"] + at["past"]
    fed = generate(engine, [prompts[i] + decoded[i].token_ids[:k] for i, k in pairs], 1, "prefill at the cuts")
    after = counter(engine, "preemptions")
    ref = [part(decoded[i], k, k + 1) for i, k in pairs]
    fed = [replace(f, prompt_token_ids=[]) for f in fed]
    n = len(at["inside"])
    floor = Floor()
    floor.add(distance(ref[:n], fed[:n]), "decode against prefill inside the window")
    # past the window a decode and a prefill may differ legitimately (docs/vllm-gpu-results.md, "Figures behind the
    # code"): each prompt decoded alone, where the only request to take the blocks a request frees is itself (its
    # writes land as the old positions leave the window), is that noise, held to the same prefills
    ctx.stage(case, f"path {path.name}: each prompt alone past the window (its floor)")
    alone = [generate(engine, [q], tokens, "each prompt alone")[0] for q in prompts]
    same = [j for j, (i, k) in enumerate(at["past"]) if alone[i].token_ids[:k + 1] == decoded[i].token_ids[:k + 1]]
    floor.add(distance([part(alone[at["past"][j][0]], at["past"][j][1], at["past"][j][1] + 1) for j in same],
                       [fed[n + j] for j in same]), "each prompt alone past the window")
    short = max(1, window - max(len(x) for x in prompts) - 1)  # the check's floor runs, inside the window
    runs = floor_runs(engine, prompts, [part(c, 0, short) for c in decoded], short)
    floor.merge(runs)
    notes = {"window": window, "block_size": block, "generated": tokens, "floor_tokens": short,
             "inside_cuts": at["inside"], "cuts": at["past"],
             "preemptions": None if after is None else after - (preempted or 0)}
    rec = verdict(case, p, path, config, floor, Trial(ref[n:], fed[n:], counted, notes), env)
    rec.metrics.update(replay_of(engine, prompts))  # the decode and the prefills at its cuts again (repro.py)
    # the batch against each prompt alone, at every position: both decode, so past the window they differ by the
    # blocks other requests took (and the batch's noise: its share inside the window, the floor runs'). A small
    # fault moves a logprob by a step of a bf16 logit as noise does, but at many positions (docs/DESIGN.md)
    alone_ref, batch, requests, share = against_alone(decoded, alone, prompts, window)
    share.merge(runs)
    judge_also(rec, p, path, ALONE, floor, share, alone_ref, batch, requests)
    return rec


ALONE = "the batch against each prompt alone"


def inside_window(prompts, window: int) -> list[int]:
    """Per prompt, how many generated positions have their whole context inside the window."""
    return [max(0, window - len(q)) for q in prompts]


def against_alone(decoded, alone, prompts, window):
    """The batch's decode past the window against each prompt's decode alone: (alone's parts, the batch's parts,
    [(prompt, first position)] of each, their floor: the same two inside the window, where nothing is freed yet).
    A prompt whose batch and lone tokens differ inside the window is left out past it (the floor says so)."""
    from kvdiag.checks.paths.engine_runs import part
    from kvdiag.checks.paths.floor import Floor, distance

    inside = inside_window(prompts, window)
    floor = Floor()
    floor.add(distance([part(a, 0, k) for a, k in zip(alone, inside)],
                       [part(d, 0, k) for d, k in zip(decoded, inside)]), f"{ALONE} inside the window")
    keep = [i for i, k in enumerate(inside) if alone[i].token_ids[:k] == decoded[i].token_ids[:k]
            and len(decoded[i].token_ids) > k]
    return ([part(alone[i], inside[i]) for i in keep], [part(decoded[i], inside[i]) for i in keep],
            [(i, inside[i]) for i in keep], floor)
