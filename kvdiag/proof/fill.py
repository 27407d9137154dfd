"""A reproducer's text: one of this package's standalone scripts with what kvdiag recorded written into its ``CASE``
line, as a Python literal a maintainer can read and edit; a script written for several engines keeps only the lines
of the case's engine (``ONLY``)."""

from __future__ import annotations

import pprint
from pathlib import Path

PLACE = "CASE: dict = {}  # filled in by kvdiag"  # the start of the line that is replaced, to its end
ONLY, END = "# only: ", "# only: end"  # a line "# only: ENGINE" starts lines for that engine alone, END ends them


def filled(script: str, case: dict, engine: str | None = None, note: str | None = None) -> str:
    """``engine``: keep that engine's lines alone (``engine_lines``); ``note``: a line of the header, under the first
    (what this script does otherwise than its text says)."""
    text = engine_lines((Path(__file__).parent / script).read_text(), engine)
    if note:
        first = text.index("\n") + 1
        text = text[:first] + f"# {note}\n" + text[first:]
    start = text.find(PLACE)
    if start < 0:
        raise ValueError(f"{script} has no '{PLACE}' line")
    end = text.index("\n", start)
    return text[:start] + "CASE = " + pprint.pformat(case, width=116, sort_dicts=False) + text[end:]


def engine_lines(text: str, engine: str | None) -> str:
    """``text`` without the lines meant for engines other than ``engine`` and without the marker lines: a vLLM
    script names no builtin engine, and the builtin engine's no vLLM."""
    out, keep = [], True
    for line in text.splitlines(keepends=True):
        mark = line.strip()
        if mark.startswith(ONLY):
            keep = mark == END or mark[len(ONLY):] == engine
            continue
        if keep:
            out.append(line)
    return "".join(out)
