"""Engine arguments as the user gives them (``-a key=value``, lm_eval's ``--model_args a=1,b=2``) -> a dict. Below
every layer that reads them: cases, lm_eval's options, the engines."""

from __future__ import annotations

import json
import re
from typing import Iterable

from kvdiag.errors import UserError


def parse_engine_args(items: Iterable[str] | None) -> dict:
    """key=value pairs, values typed as JSON where they parse (2, 0.5, true, null, [..]) else strings. One item may
    hold several, comma-separated as lm_eval's --model_args (``a=1,b=2``), when every part is key=value (a value
    with commas of its own, ``sizes=[1,2]``, stays whole)."""
    out = {}
    for item in (part for given in items or () for part in _split_pairs(given)):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--engine-arg '{item}' is not key=value")
        low = raw.strip()
        try:
            value = json.loads({"True": "true", "False": "false", "None": "null"}.get(low, low))
        except ValueError:
            value = raw
        out[key.strip().replace("-", "_")] = value
    return out


def _split_pairs(item: str) -> list[str]:
    parts = item.split(",")
    keyed = all(re.fullmatch(r"\s*[A-Za-z_][\w-]*\s*=.*", x, re.S) for x in parts)
    return parts if len(parts) > 1 and keyed else [item]
