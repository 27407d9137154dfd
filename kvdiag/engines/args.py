"""Engine arguments as the user gives them (``-a key=value``, lm_eval's ``--model_args a=1,b=2``) -> a dict. Below
every layer that reads them: cases, lm_eval's options, the engines. The parsing itself is kvdiag/keyvalue.py."""

from __future__ import annotations

from typing import Iterable


def parse_engine_args(items: Iterable[str] | None) -> dict:
    """-a/--engine-arg key=value pairs (kvdiag.keyvalue: several per item, comma-separated as lm_eval's
    --model_args; values JSON-ish: ``sizes=[1,2]``, ``name="a,b"``)."""
    from kvdiag.keyvalue import parse_pairs

    return parse_pairs("--engine-arg", items)
