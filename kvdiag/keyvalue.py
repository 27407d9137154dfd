"""The one ``key=value`` parser: ``-a/--engine-arg`` (lm_eval's ``--model_args``), ``--gen-kwargs`` and
``--metadata``. Pairs are separated by commas outside brackets and quotes; values are JSON-ish:

    block_size=16,sizes=[1,2]      -> {'block_size': 16, 'sizes': [1, 2]}
    name="a,b",x={"a":1,"b":2}     -> {'name': 'a,b', 'x': {'a': 1, 'b': 2}}
    enforce_eager=true,dtype=half  -> {'enforce_eager': True, 'dtype': 'half'}

A value is JSON where it parses (numbers, true/false/null, lists, objects, "strings"), else a Python literal
(``'a,b'``, ``True``, ``None``, tuples), else the text itself; ``true``/``false``/``none`` in any case are the
booleans and None, as lm_eval reads them. A value that holds a comma of its own is quoted or bracketed. Nothing
here imports more than the standard library."""

from __future__ import annotations

import ast
import json
import re
from typing import Iterable

from kvdiag.errors import UserError

_KEY = re.compile(r"[A-Za-z_][\w.-]*")
_WORDS = {"true": True, "false": False, "none": None, "null": None}
_OPEN, _CLOSE = "[{(", "]})"


def split_pairs(text: str, flag: str = "") -> list[str]:
    """``text`` cut at the commas outside brackets and quotes (a quote counts where a value or an item starts, so
    ``name=it's`` is one value); empty parts dropped. Unbalanced brackets or an open quote: UserError."""
    parts, cur, depth, quote, escaped = [], [], 0, None, False
    for ch in text:
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'" and (not "".join(cur).strip() or "".join(cur).rstrip()[-1] in "=:,[{("):
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                raise UserError(f"{flag + ' ' if flag else ''}'{text}': '{ch}' closes a bracket that was not opened")
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if quote or depth:
        raise UserError(f"{flag + ' ' if flag else ''}'{text}': {'a quote' if quote else 'a bracket'} is not closed")
    return [p for p in (*parts, "".join(cur)) if p.strip()]


def parse_value(raw: str):
    """One value, typed as the module docstring says."""
    text = raw.strip()
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def parse_pairs(flag: str, items: Iterable[str] | None) -> dict:
    """``key=value`` pairs from each item (several per item, comma-separated); keys with ``-`` read as ``_``.
    Not key=value: UserError naming ``flag``."""
    out = {}
    for given in items or ():
        for part in split_pairs(given, flag):
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or not _KEY.fullmatch(key):
                raise UserError(f"{flag} '{part.strip()}' is not key=value (pairs are separated by commas; quote a "
                                "value that holds one: name=\"a,b\")")
            out[key.replace("-", "_")] = parse_value(raw)
    return out
