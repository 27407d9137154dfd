"""The fixed prompt set that drift (and other checks) score and generate from.

Deterministic: the same prompts in every run, every process, every Python version
(``random.Random`` with a fixed seed). Two sets:

- ``recall`` (the shipped tiny model, and any model trained on kvdiag's recall
  format): key=value contexts of 3-18 pairs (32-182 tokens) in the format of
  ``kvdiag/tasks/recall.py``, with held-out keys; the teacher-forced continuation
  asks three keys with their answers, so the scored positions are where the model
  must read values back from the KV cache.
- ``text``: short English passages for any other model.

Each prompt also has a long continuation of its generation prompt (``long``, at least ``LONG_CHARS``
characters; the drift probe scores its first ``drift.LONG_TOKENS`` tokens teacher-forced, checks/sweep/drift.py):
for ``recall``, the answer to the asked key, then every pair of the context asked again in the training format
(`` k1=v1 k2=v2 ...``, shuffled, repeated until long enough), so every value read back comes from further along
the cache; for ``text``, the passage's continuation and then the other passages in turn. It is fixed text, the
same for every kv dtype, so that positions align between them all along it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

RECALL_SEED = 5150
N_PROMPTS = 12
QUERIES = 3
LONG_CHARS = 600  # >= 128 tokens of a byte tokenizer (1 a character) or of English BPE (~4 characters a token)


@dataclass(frozen=True)
class Prompt:
    context: str  # prefilled into the KV cache
    continuation: str  # scored teacher-forced after the context
    generate: str  # greedy generation starts from this text
    long: str = ""  # a long fixed continuation of ``generate`` (drift by position along it)


def recall_prompts(n: int = N_PROMPTS, seed: int = RECALL_SEED) -> list[Prompt]:
    from kvdiag.tasks import recall

    rng = random.Random(seed)
    keys = [k for k in range(0, recall.N_KEYS, 7) if recall.is_heldout(k)]
    out = []
    for i in range(n):
        n_pairs = 3 + (15 * i) // max(1, n - 1)  # 3 .. 18 pairs, spread over the set
        key_ids = rng.sample(keys, n_pairs)
        values = rng.sample(range(recall.N_VALUES), n_pairs)
        pairs = [(recall.key_text(k), recall.value_text(v)) for k, v in zip(key_ids, values)]
        asked = rng.sample(range(n_pairs), min(QUERIES, n_pairs))
        context = recall.context_text(pairs)
        continuation = "".join(recall.question_text(pairs[j][0]) + pairs[j][1] for j in asked)
        out.append(Prompt(context, continuation, context + recall.question_text(pairs[asked[0]][0]),
                          _recall_long(pairs, pairs[asked[0]][1], random.Random(seed + 1 + i))))
    return out


def _recall_long(pairs: list[tuple[str, str]], answer: str, rng: random.Random) -> str:
    """The asked key's answer, then the context's pairs asked again in the training format, each round shuffled."""
    from kvdiag.tasks import recall

    text = answer
    while len(text) < LONG_CHARS:
        text += "".join(recall.question_text(k) + v for k, v in rng.sample(pairs, len(pairs)))
    return text


_TEXT = [
    ("The river rises in the hills north of the town and runs south through farmland for forty miles",
     " before it reaches the sea at the old harbour."),
    ("To make bread you need flour, water, salt and yeast. Mix them, knead the dough for ten minutes",
     " and leave it to rise in a warm place for an hour."),
    ("The committee met on Tuesday to discuss the budget for next year. After a long debate",
     " the members agreed to spend more on schools and less on roads."),
    ("In 1969 two astronauts walked on the surface of the Moon while a third stayed in orbit",
     " and waited for them to return."),
    ("A prime number is a whole number greater than one whose only divisors are one and itself",
     ", so the first few primes are two, three, five, seven and eleven."),
    ("The library opens at nine in the morning and closes at six in the evening on weekdays",
     ", and it is closed on Sundays and public holidays."),
    ("She opened the letter, read it twice, and then sat down by the window without a word",
     " while the rain kept falling on the empty street."),
    ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):",
     "\n        a, b = b, a + b\n    return a\n"),
]


def text_prompts(n: int = 8) -> list[Prompt]:
    return [Prompt(c, x, c, _text_long(i)) for i, (c, x) in enumerate(_TEXT[:n])]


def _text_long(i: int) -> str:
    """Passage ``i``'s continuation, then the next passages whole, in turn, until long enough."""
    text, j = _TEXT[i][1], i
    while len(text) < LONG_CHARS:
        j = (j + 1) % len(_TEXT)
        text += " " + "".join(_TEXT[j])
    return text


def is_shipped_model(model: str) -> bool:
    from kvdiag.assets import TINY_MODEL

    try:
        return Path(model).resolve() == Path(TINY_MODEL).resolve()
    except OSError:
        return False


def prompt_set(model: str, kind: str = "auto", limit: int | None = None) -> list[Prompt]:
    """``recall`` for the shipped model (``auto``), ``text`` for other models; or as asked.
    ``limit``: only the first prompts (the shortest recall ones), e.g. for ``kvdiag selftest``."""
    if kind == "auto":
        kind = "recall" if is_shipped_model(model) else "text"
    if kind == "recall":
        return recall_prompts()[:limit]
    if kind == "text":
        return text_prompts()[:limit]
    raise ValueError(f"unknown prompt set '{kind}' (recall, text, auto)")


def case_prompts(case) -> list[Prompt]:
    """The prompts a case asks for: ``params['prompts']`` (the set) and ``params['num_prompts']`` (how many)."""
    return prompt_set(case.model, case.params.get("prompts") or "auto", case.params.get("num_prompts"))
