"""The needle grid: kv-recall documents (``recall.py``'s format) over context length x needle depth, made at run time
for the engine's window (``kv_needle``) or written by ``scripts/make_tasks.py``.

A document of the cell (length L, depth d) holds as many pairs as fit L tokens (the byte tokenizer's: a BOS, 10 a
pair, the question and the 4-token answer; at most L - 1 in all, so that vLLM, which keeps one token of its window
for a sampled one, scores it whole), and asks the pair at ``round(d x (pairs - 1))``: depth 0 is the first pair,
the oldest in the cache, depth 1 the last. A tokenizer that merges bytes makes it shorter in tokens, never longer.
The documents go round the cells (every cell once, then again), so ``--limit`` keeps the grid whole; each one has
a seed of its own cell and index, so the same cell gets the same documents in a grid of other lengths. Tags on
each document: ``needle_length``, ``needle_depth``, ``position``, ``n_pairs``, ``tokens``.
"""

from __future__ import annotations

import random

from kvdiag.tasks import recall

TASK = "kv_needle"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PER_CELL = 4  # documents a cell: a CPU run stays within minutes; --limit takes fewer, whole rounds of the grid
SEED = 48
LENGTHS = 5  # default lengths: the window and its halves
# tokens beside the pairs: BOS, " ;" after the last pair (whose own trailing space it replaces), " key=", the answer
OVERHEAD = 1 + 1 + len(recall.question_text("a" * recall.KEY_LEN)) + recall.VALUE_LEN
MIN_PAIRS = len(DEPTHS)  # each depth its own pair
MIN_LENGTH = MIN_PAIRS * recall.PAIR_TOKENS + OVERHEAD + 1
MAX_LENGTH = recall.N_VALUES * recall.PAIR_TOKENS  # every value of a context distinct


def pairs_for(length: int) -> int:
    """Pairs of a document of at most ``length`` tokens (its tokens at most ``length - 1``)."""
    return (length - 1 - OVERHEAD) // recall.PAIR_TOKENS


def tokens_for(n_pairs: int) -> int:
    """The tokens of a document of ``n_pairs`` pairs, as the byte tokenizer counts them (BOS and answer included)."""
    return n_pairs * recall.PAIR_TOKENS + OVERHEAD


def position(depth: float, n_pairs: int) -> int:
    """The needle's pair at ``depth`` (nearest, halves up)."""
    return int(depth * (n_pairs - 1) + 0.5)


def default_lengths(window: int) -> list[int]:
    """The window and its halves, the shortest of them at least MIN_LENGTH."""
    return sorted({window >> k for k in range(LENGTHS) if window >> k >= MIN_LENGTH})


def length_problem(lengths: list[int], window: int, where: str) -> str | None:
    """Why ``lengths`` cannot make a grid for an engine of ``window`` tokens (``where`` says whose), or None."""
    for n in lengths:
        if n < MIN_LENGTH:
            return f"needle length {n}: at least {MIN_LENGTH} tokens (a pair for each of the {len(DEPTHS)} depths)"
        if n > window:
            return f"needle length {n}: longer than {where} ({window} tokens)"
        if n > MAX_LENGTH:
            return f"needle length {n}: at most {MAX_LENGTH} tokens (a context's values are distinct 4-digit numbers)"
    return None


def make_doc(rng: random.Random, keys: list[int], idx: int, length: int, depth: float) -> dict:
    n = pairs_for(length)
    key_ids = rng.sample(keys, n)
    values = rng.sample(range(recall.N_VALUES), n)
    pairs = [(recall.key_text(k), recall.value_text(v)) for k, v in zip(key_ids, values)]
    at = position(depth, n)
    key, value = pairs[at]
    choices = rng.sample([v for i, (_, v) in enumerate(pairs) if i != at], 3) + [value]
    rng.shuffle(choices)
    return {"id": idx, "context": recall.prompt(pairs, key), "choices": choices, "answer": choices.index(value),
            "key": key, "position": at, "n_pairs": n, "tokens": tokens_for(n), "needle_length": length,
            "needle_depth": depth}


def documents(lengths: list[int], depths=DEPTHS, per_cell: int = PER_CELL, seed: int = SEED) -> list[dict]:
    """The grid's documents, round the cells ``per_cell`` times (lengths outer, depths inner)."""
    keys = [k for k in range(recall.N_KEYS) if recall.is_heldout(k)]
    docs = []
    for k in range(per_cell):
        for length in sorted(lengths):
            for depth in depths:
                rng = random.Random(f"{TASK}/{seed}/{length}/{depth}/{k}")  # str seeds: sha512, stable
                docs.append(make_doc(rng, keys, len(docs), length, depth))
    return docs
