"""The key-value recall text format, shared by the shipped tasks and the tiny model's training.

A context binds 4-letter keys to 4-digit values, ends with `` ;``, then asks for
one key; the answer is its value::

    fqza=7261 kmbt=0932 ... wxyz=1180 ; kmbt=   ->   0932

Every character is ASCII, so the byte tokenizer gives one token per character:
a pair costs 10 tokens. Training queries several keys in a row
(`` ; kmbt=0932 fqza=7261 ...``); a task asks the first one.

Keys are numbered 0..26**4-1. The held-out keys (``is_heldout``, ~1/16 of them)
appear only in the shipped task data, never in training.
"""

from __future__ import annotations

import string

LETTERS = string.ascii_lowercase
KEY_LEN = 4
VALUE_LEN = 4
N_KEYS = len(LETTERS) ** KEY_LEN
N_VALUES = 10**VALUE_LEN
PAIR_TOKENS = KEY_LEN + 1 + VALUE_LEN + 1  # "kmbt=0932 "
HELDOUT_MOD = 16
_HASH = 2654435761  # Knuth's multiplicative hash


def is_heldout(key_id):
    """True for the keys reserved for evaluation (works on ints and numpy int64 arrays)."""
    return ((key_id * _HASH) >> 11) % HELDOUT_MOD == 0


def key_text(key_id: int) -> str:
    chars = []
    for _ in range(KEY_LEN):
        key_id, r = divmod(key_id, len(LETTERS))
        chars.append(LETTERS[r])
    return "".join(chars)


def value_text(value: int) -> str:
    return f"{value:0{VALUE_LEN}d}"


def context_text(pairs: list[tuple[str, str]]) -> str:
    """``"k1=v1 k2=v2 ... kn=vn ;"``"""
    return " ".join(f"{k}={v}" for k, v in pairs) + " ;"


def question_text(key: str) -> str:
    return f" {key}="


def prompt(pairs: list[tuple[str, str]], key: str, answered: list[tuple[str, str]] = ()) -> str:
    """The text a task scores continuations after; the answer follows with no separator. ``answered`` pairs come
    first as queries already answered (`` ; k1=v1 k2=v2 key=``, the training format)."""
    return context_text(pairs) + "".join(question_text(k) + v for k, v in answered) + question_text(key)
