#!/usr/bin/env python3
"""Generate the shipped lm_eval task data (kvdiag/tasks/data/*.jsonl), deterministically.

    python scripts/make_tasks.py                 # rewrites kvdiag/tasks/data/
    python scripts/make_tasks.py --out-dir /tmp/x

kv_recall:       200 documents, 16 pairs, the asked key anywhere in the context.
kv_recall_long:  100 documents, 64-96 pairs (~650-970 tokens), the asked key in
                 the first 10% of the pairs.
Each document offers 4 choices, all values of the same context (the right one
and 3 others). Keys are drawn only from the held-out keys (recall.is_heldout),
which training never uses, and with seeds of their own. Uses Python's `random`
(stable across versions), so the bytes are reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdiag.tasks import recall  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "kvdiag" / "tasks" / "data"

# name: (seed, documents, (min pairs, max pairs), fraction of the context the key is asked from)
SPECS = {
    "kv_recall": (20260101, 200, (16, 16), 1.0),
    "kv_recall_long": (20260102, 100, (64, 96), 0.1),
}


def make_doc(rng: random.Random, keys: list[int], idx: int, n_pairs: int, first_frac: float) -> dict:
    key_ids = rng.sample(keys, n_pairs)
    values = rng.sample(range(recall.N_VALUES), n_pairs)
    pairs = [(recall.key_text(k), recall.value_text(v)) for k, v in zip(key_ids, values)]
    position = rng.randrange(max(1, math.ceil(first_frac * n_pairs)))
    key, value = pairs[position]
    others = rng.sample([v for i, (_, v) in enumerate(pairs) if i != position], 3)
    choices = others + [value]
    rng.shuffle(choices)
    return {
        "id": idx,
        "context": recall.prompt(pairs, key),
        "choices": choices,
        "answer": choices.index(value),
        "key": key,
        "position": position,
        "n_pairs": n_pairs,
    }


def make_task(name: str) -> list[dict]:
    seed, n_docs, (lo, hi), first_frac = SPECS[name]
    rng = random.Random(seed)
    keys = [k for k in range(recall.N_KEYS) if recall.is_heldout(k)]
    return [make_doc(rng, keys, i, rng.randint(lo, hi), first_frac) for i in range(n_docs)]


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in SPECS:
        path = out_dir / f"{name}.jsonl"
        lines = [json.dumps(doc, ensure_ascii=True) for doc in make_task(name)]
        path.write_text("\n".join(lines) + "\n", encoding="ascii")
        paths.append(path)
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for path in write_all(args.out_dir):
        print(path)


if __name__ == "__main__":
    main()
