"""A reproducer's text: one of this package's standalone scripts with what kvdiag recorded written into its ``CASE``
line, as a Python literal a maintainer can read and edit."""

from __future__ import annotations

import pprint
from pathlib import Path

PLACE = "CASE: dict = {}  # filled in by kvdiag"  # the start of the line that is replaced, to its end


def filled(script: str, case: dict) -> str:
    text = (Path(__file__).parent / script).read_text()
    start = text.find(PLACE)
    if start < 0:
        raise ValueError(f"{script} has no '{PLACE}' line")
    end = text.index("\n", start)
    return text[:start] + "CASE = " + pprint.pformat(case, width=116, sort_dicts=False) + text[end:]
