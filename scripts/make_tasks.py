#!/usr/bin/env python3
"""Generate the shipped lm_eval task data (kvdiag/tasks/data/*.jsonl), deterministically, or a task of your own
difficulty.

    python scripts/make_tasks.py                 # rewrites kvdiag/tasks/data/
    python scripts/make_tasks.py --out-dir /tmp/x
    python scripts/make_tasks.py --name kv_recall_hard --pairs 150-190 --first-frac 0.1 --out-dir /tmp/hard
    kvdiag accuracy --include-path /tmp/hard -t kv_recall_hard

kv_recall:       200 documents, 16 pairs, the asked key anywhere in the context.
kv_recall_long:  100 documents, 64-96 pairs (~650-970 tokens), the asked key in
                 the first 10% of the pairs.
kv_recall_p128:  100 documents, 112-144 pairs (~1.1-1.4k tokens), the key anywhere.
kv_recall_p152:  100 documents, 144-160 pairs (~1.4-1.6k tokens), the key anywhere.
kv_recall_p176:  100 documents, 160-190 pairs (~1.6-1.9k tokens), the key anywhere.
kv_recall_p176_early:
                 100 documents, 160-190 pairs, the key in the first 10% of the pairs (1.5k tokens back or more).
                 All four are longer than anything the tiny models were trained on (at most 100 pairs), so recall
                 degrades: zoo:qwen3 scores 0.92 and 0.81 with auto (docs/zoo.md).
kv_recall_p450_early, kv_recall_p550_early:
                 100 documents each, 400-500 and 500-600 pairs (4.0-5.0k and 5.0-5.9k tokens), the key in the first
                 10%: past zoo:gemma3's training window, which kv_recall_p176_early is not (it scores 1.0 there).
kv_needle:       made when it loads, not here: context length x needle depth up to the engine's window
                 (kvdiag/tasks/needle.py); --needle writes the same documents for lengths of your own.
kv_decode:       100 documents, 48-64 pairs, a conversation (kvdiag/tasks/kv_turns.py): the model writes a chain of
                 1, 2, 4, 8 or 16 pairs of the context (the lengths in turn), each from its key's first letter, which
                 no other key of the context has; exact match of the whole chain.
kv_multiturn:    100 documents, 32-48 pairs, a conversation of 12 turns, each asking a key; exact match of every
                 turn's value. Both are generated (CONVERSATIONS), and tuned so that the auto baselines of the tiny
                 model and zoo:qwen3 score between 0.6 and 0.95 (docs/zoo.md).
Each document offers 4 choices, all values of the same context (the right one
and 3 others). Keys are drawn only from the held-out keys (recall.is_heldout),
which training never uses, and with seeds of their own. Uses Python's `random`
(stable across versions), so the bytes are reproducible.

With --name, one task of that name goes to --out-dir: NAME.jsonl, NAME.yaml and a copy of kv_utils.py (the YAML's
loader), ready for ``--include-path``. Its difficulty: --pairs (context length, 10 tokens a pair), --first-frac
(where the asked key is), --queries Q (Q answered queries between the context and the asked one: the training
format, and what a long generation leaves in the cache before the answer), --generate (the model writes the value,
greedy, scored by exact match of all digits, instead of choosing among 4; --gen-toks caps the generation).
With --needle L1,L2,... it is kv_needle's grid at those lengths instead (--per-cell documents a cell; kvdiag
accuracy draws any task of tagged documents as a grid):

    python scripts/make_tasks.py --name my_needle --needle 512,1024,2048 --per-cell 10 --out-dir /tmp/needle
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdiag.tasks import TASKS_DIR, needle, recall  # noqa: E402
from kvdiag.tasks.kv_turns import TURN  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "kvdiag" / "tasks" / "data"

# name: (seed, documents, (min pairs, max pairs), fraction of the context the key is asked from)
SPECS = {
    "kv_recall": (20260101, 200, (16, 16), 1.0),
    "kv_recall_long": (20260102, 100, (64, 96), 0.1),
    # harder: longer than the training curriculum's 100 pairs (seed 1: the --name default they were first made with)
    "kv_recall_p128": (1, 100, (112, 144), 1.0),
    "kv_recall_p152": (1, 100, (144, 160), 1.0),
    "kv_recall_p176": (1, 100, (160, 190), 1.0),
    "kv_recall_p176_early": (2, 100, (160, 190), 0.1),  # the asked key far back: where the Llama shapes fail
    # past zoo:gemma3's 2k training window (its global layers see the whole context): 4.5-6k tokens
    "kv_recall_p450_early": (3, 100, (400, 500), 0.1),
    "kv_recall_p550_early": (3, 100, (500, 600), 0.1),
}

# Conversation tasks (kvdiag/tasks/kv_turns.py): name: (seed, documents, (min pairs, max pairs), fraction of the
# context the keys are asked from, lengths taken in turn by the documents, kind). "chain": the model writes N pairs,
# each from its key's first letter, which no other key of the context has; "turns": N turns, each asks a key and
# the model answers its value.
CONVERSATIONS = {
    "kv_decode": (20260201, 100, (48, 64), 1.0, (1, 2, 4, 8, 16), "chain"),
    "kv_multiturn": (20260202, 100, (32, 48), 1.0, (12,), "turns"),
}
CHAIN_TOKENS = recall.KEY_LEN + recall.VALUE_LEN  # a chain's answer: the key's last 3 letters, "=", the value


def make_doc(rng: random.Random, keys: list[int], idx: int, n_pairs: int, first_frac: float,
             queries: int = 0) -> dict:
    key_ids = rng.sample(keys, n_pairs)
    values = rng.sample(range(recall.N_VALUES), n_pairs)
    pairs = [(recall.key_text(k), recall.value_text(v)) for k, v in zip(key_ids, values)]
    position = rng.randrange(max(1, math.ceil(first_frac * n_pairs)))
    key, value = pairs[position]
    others = rng.sample([v for i, (_, v) in enumerate(pairs) if i != position], 3)
    choices = others + [value]
    rng.shuffle(choices)
    answered = [pairs[i] for i in rng.sample([i for i in range(n_pairs) if i != position], queries)] if queries else []
    doc = {
        "id": idx,
        "context": recall.prompt(pairs, key, answered),
        "choices": choices,
        "answer": choices.index(value),
        "key": key,
        "position": position,
        "n_pairs": n_pairs,
    }
    if queries:
        doc["queries"] = queries
    return doc


def make_task(name: str, spec: tuple | None = None, queries: int = 0) -> list[dict]:
    seed, n_docs, (lo, hi), first_frac = spec or SPECS[name]
    rng = random.Random(seed)
    keys = [k for k in range(recall.N_KEYS) if recall.is_heldout(k)]
    return [make_doc(rng, keys, i, rng.randint(lo, hi), first_frac, queries) for i in range(n_docs)]


def make_conversation(name: str) -> list[dict]:
    seed, n_docs, (lo, hi), first_frac, lengths, kind = CONVERSATIONS[name]
    rng = random.Random(seed)
    keys = [k for k in range(recall.N_KEYS) if recall.is_heldout(k)]
    if kind == "chain":
        by_letter = {letter: [k for k in keys if recall.key_text(k)[0] == letter] for letter in recall.LETTERS}
        return [chain_doc(rng, by_letter, i, rng.randint(lo, hi), first_frac, lengths[i % len(lengths)])
                for i in range(n_docs)]
    return [turns_doc(rng, keys, i, rng.randint(lo, hi), first_frac, lengths[i % len(lengths)])
            for i in range(n_docs)]


def _asked(rng: random.Random, n_pairs: int, first_frac: float, n: int) -> list[int]:
    """The context positions of ``n`` asked keys, in the order they are asked, within the first ``first_frac``."""
    return rng.sample(range(max(n, math.ceil(first_frac * n_pairs))), n)


def chain_doc(rng: random.Random, by_letter: dict[str, list[int]], idx: int, n_pairs: int, first_frac: float,
              length: int) -> dict:
    """The model writes ``length`` pairs of the context in a row; each turn gives the next key's first letter only,
    and no other key of the context starts with it, so the pair to write is known. ``by_letter``: the held-out keys
    by first letter."""
    letters = rng.sample(recall.LETTERS, length)
    key_ids = rng.sample([k for c in recall.LETTERS if c not in letters for k in by_letter[c]], n_pairs - length)
    asked = _asked(rng, n_pairs, first_frac, length)
    for pos, letter in sorted(zip(asked, letters)):
        key_ids.insert(pos, rng.choice(by_letter[letter]))
    pairs = [(recall.key_text(k), recall.value_text(v)) for k, v in zip(key_ids, rng.sample(range(recall.N_VALUES),
                                                                                           n_pairs))]
    texts = [recall.context_text(pairs) + " " + pairs[asked[0]][0][0]] + [" " + pairs[p][0][0] for p in asked[1:]]
    answers = [pairs[p][0][1:] + "=" + pairs[p][1] for p in asked]
    return _conversation(idx, pairs, asked, texts, answers)


def turns_doc(rng: random.Random, keys: list[int], idx: int, n_pairs: int, first_frac: float, turns: int) -> dict:
    """``turns`` turns over one context: each asks a key (`` key=``) and the model answers its value."""
    pairs = [(recall.key_text(k), recall.value_text(v))
             for k, v in zip(rng.sample(keys, n_pairs), rng.sample(range(recall.N_VALUES), n_pairs))]
    asked = _asked(rng, n_pairs, first_frac, turns)
    texts = [recall.prompt(pairs, pairs[asked[0]][0])]
    texts += [recall.question_text(pairs[p][0]) for p in asked[1:]]
    return _conversation(idx, pairs, asked, texts, [pairs[p][1] for p in asked])


def _conversation(idx: int, pairs, asked: list[int], texts: list[str], answers: list[str]) -> dict:
    return {"id": idx, "context": TURN.join(texts), "answers": answers, "target": TURN.join(answers),
            "keys": [pairs[p][0] for p in asked], "positions": asked, "n_pairs": len(pairs)}


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(doc, ensure_ascii=True) for doc in docs) + "\n", encoding="ascii")
    return path


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return ([write_jsonl(out_dir / f"{name}.jsonl", make_task(name)) for name in SPECS]
            + [write_jsonl(out_dir / f"{name}.jsonl", make_conversation(name)) for name in CONVERSATIONS])


def task_yaml(name: str, describe: str, generate: bool, gen_toks: int) -> str:
    """The lm_eval config of a custom task: the shipped tasks' multiple choice, or a greedy generation of the value
    scored by exact match of its digits."""
    head = (f"# {describe} (scripts/make_tasks.py)\ntag:\n  - kvdiag_custom\ntask: {name}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {name}.jsonl\ncustom_dataset: !function kv_utils.load_json\n"
            "test_split: test\ndoc_to_text: context\n")
    if not generate:
        return head + ("output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: answer\n"
                       'target_delimiter: ""\nmetric_list:\n  - metric: acc\n    aggregation: mean\n'
                       "    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    return head + ("output_type: generate_until\ndoc_to_target: \"{{choices[answer]}}\"\ntarget_delimiter: \"\"\n"
                   f"generation_kwargs:\n  until: [\" \", \";\"]\n  max_gen_toks: {gen_toks}\n  do_sample: false\n"
                   "  temperature: 0.0\nfilter_list:\n  - name: value\n    filter:\n      - function: regex\n"
                   f"        regex_pattern: \"(\\\\d{{{recall.VALUE_LEN}}})\"\n      - function: take_first\n"
                   "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
                   "metadata:\n  version: 1.0\n")


def write_custom(a, out_dir: Path) -> list[Path]:
    lo, _, hi = a.pairs.partition("-")
    pairs = (int(lo), int(hi or lo))
    spec = (1 if a.seed is None else a.seed, a.docs, pairs, a.first_frac)
    docs = make_task(a.name, spec, a.queries)
    describe = (f"{a.docs} documents, {pairs[0]}-{pairs[1]} pairs, the key in the first {a.first_frac:g} of them, "
                f"{a.queries} answered queries first, " + ("generated" if a.generate else "4 choices"))
    if a.needle:
        lengths = _lengths(a.needle)
        docs = needle.documents(lengths, per_cell=a.per_cell, seed=needle.SEED if a.seed is None else a.seed)
        describe = (f"kv_needle's grid: lengths {', '.join(map(str, lengths))} x depths "
                    f"{', '.join(f'{d:g}' for d in needle.DEPTHS)}, {a.per_cell} documents a cell, 4 choices")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{a.name}.yaml").write_text(task_yaml(a.name, describe, a.generate, a.gen_toks))
    shutil.copy2(TASKS_DIR / "kv_utils.py", out_dir / "kv_utils.py")
    return [write_jsonl(out_dir / f"{a.name}.jsonl", docs), out_dir / f"{a.name}.yaml"]


def _lengths(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def _check(p, a) -> None:
    if a.name is None:
        if a.needle:
            p.error("--needle needs --name and --out-dir")
        return
    if a.name in SPECS or a.name in CONVERSATIONS or not a.name.replace("_", "").isalnum():
        p.error(f"--name {a.name!r}: give a new task name (letters, digits, _), not a shipped one")
    if a.out_dir == DEFAULT_OUT:
        p.error("--name needs --out-dir (a folder to pass to kvdiag accuracy --include-path)")
    lo, _, hi = a.pairs.partition("-")
    ok = lo.isdigit() and (not hi or hi.isdigit()) and 4 <= int(lo) <= int(hi or lo) <= recall.N_KEYS // 16
    if not ok:
        p.error(f"--pairs {a.pairs!r}: N or LO-HI, at least 4")
    if not 0 < a.first_frac <= 1 or a.docs < 1 or a.queries < 0 or a.gen_toks < recall.VALUE_LEN:
        p.error("--first-frac in (0, 1], --docs >= 1, --queries >= 0, --gen-toks >= the value's digits")
    if a.queries >= int(lo):
        p.error(f"--queries {a.queries}: fewer than the pairs ({lo})")
    if a.needle:
        ok = all(x.strip().isdigit() for x in a.needle.split(",") if x.strip()) and _lengths(a.needle)
        problem = needle.length_problem(_lengths(a.needle), needle.MAX_LENGTH, "the format") if ok else \
            "give token counts, comma-separated"
        if problem or a.generate or a.queries or a.per_cell < 1:
            p.error(f"--needle {a.needle}: {problem or 'with --per-cell >= 1, and neither --generate nor --queries'}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--name", help="write one task of this name and the difficulty below (default: the shipped)")
    p.add_argument("--pairs", default="16", help="pairs per context: N or LO-HI (10 tokens a pair)")
    p.add_argument("--first-frac", type=float, default=1.0, help="the asked key is in this first part of pairs")
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--seed", type=int, help="default: 1; with --needle, kv_needle's (the same documents)")
    p.add_argument("--queries", type=int, default=0, help="answered queries before the asked key")
    p.add_argument("--generate", action="store_true", help="generate the value (exact match), not 4 choices")
    p.add_argument("--gen-toks", type=int, default=8, help="max_gen_toks of --generate")
    p.add_argument("--needle", help="kv_needle's grid at these lengths (tokens, comma-separated) instead")
    p.add_argument("--per-cell", type=int, default=needle.PER_CELL, help="documents a cell of --needle's grid")
    args = p.parse_args(argv)
    _check(p, args)
    for path in write_custom(args, args.out_dir) if args.name else write_all(args.out_dir):
        print(path)


if __name__ == "__main__":
    main()
