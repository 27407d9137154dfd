"""A reproducer's text: one of this package's standalone scripts with what kvdiag recorded written into its ``CASE``
line, as a Python literal a maintainer can read and edit."""

from __future__ import annotations

import pprint
from pathlib import Path

PLACE = "CASE: dict = {}  # filled in by kvdiag"  # the start of the line that is replaced, to its end


def filled(script: str, case: dict, note: str | None = None) -> str:
    """``note``: a line of the header, under the first (what this script does otherwise than its text says)."""
    text = (Path(__file__).parent / script).read_text()
    if note:
        first = text.index("\n") + 1
        text = text[:first] + f"# {note}\n" + text[first:]
    start = text.find(PLACE)
    if start < 0:
        raise ValueError(f"{script} has no '{PLACE}' line")
    end = text.index("\n", start)
    return text[:start] + "CASE = " + pprint.pformat(case, width=116, sort_dicts=False) + text[end:]
