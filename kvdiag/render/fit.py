"""How a table meets the terminal's width (80 columns and up): a table is printed as it is where it fits; where it
does not, a narrower layout of the check's own (``fitting``), or each row as a record of "header: value" pairs
(``show``). No number or word is ever cut, and no single long cell sets the width of the others."""

from __future__ import annotations

from typing import Callable

RECORD_INDENT = 2
PAIR_GAP = "   "
PROSE_WIDTH = 30  # the narrowest a wrapped finding is still read as prose


def natural_width(con, table) -> int:
    """The columns a table takes when none is wrapped (unclamped by the console's width): whether it fits."""
    from rich.measure import Measurement

    return Measurement.get(con, con.options.update(max_width=10_000), table).maximum


def fitting(con, *builders: Callable):
    """The table of the first builder whose natural width fits the console, else the last one's."""
    for make in builders:
        t = make()
        if natural_width(con, t) <= con.width:
            break
    return t


def folded(items: list[tuple[str, str, str]]) -> list[str]:
    """Rows that would repeat one reason (a case unsupported, say) as one line per reason: ``items`` are (what, kv
    dtype, reason) -> "what, what (dtype, dtype): reason", the names in their first order."""
    by: dict[str, tuple[dict, dict]] = {}
    for what, dtype, reason in items:
        names, dtypes = by.setdefault(reason, ({}, {}))
        names[what] = dtypes[dtype] = None
    return [f"{', '.join(n)} ({', '.join(d)}): {reason}" for reason, (n, d) in by.items()]


def with_path(con, text: str, path) -> None:
    """Print ``text`` then ``path`` on one line where it fits; else the path on a line of its own, never broken, so
    that it can be copied whole (a path wider than the terminal is left to the terminal to wrap)."""
    from rich.markup import escape

    if len(con.render_str(text).plain) + 1 + len(str(path)) <= con.width:
        con.print(f"{text} {escape(str(path))}", soft_wrap=True)
    else:
        con.print(text)
        con.print(str(path), soft_wrap=True, markup=False, highlight=False)


def show(con, table, heading: int = 1) -> None:
    """Print ``table`` where it fits, its headers wrapped between words if need be (never a cell); else its title,
    then each row as a record: its first ``heading`` cells on a line, its other non-empty cells as "header: value"
    pairs packed into lines of the console's width."""
    from rich.text import Text

    if natural_width(con, table) <= con.width or _headers_wrapped(con, table):
        con.print(table)
        return
    if table.title:
        con.print(table.title)
    for cells in rows_of(table):
        con.print(" ".join(c for c in cells[:heading] if _plain(c)))
        pairs = [f"[dim]{_plain(col.header)}:[/] {c}" for col, c in zip(table.columns[heading:], cells[heading:])
                 if _plain(c)]
        for line in _packed(pairs, con.width - RECORD_INDENT):  # a wrapped pair stays indented
            for part in Text.from_markup(line).wrap(con, con.width - RECORD_INDENT):
                part.rstrip()
                con.print(Text(" " * RECORD_INDENT) + part)


def _headers_wrapped(con, table) -> bool:
    """Whether ``table`` fits once its headers wrap between words while every cell keeps one line, but for prose
    (a column with a ``max_width``: a finding), which wraps between words at no less than ``PROSE_WIDTH``; if so, its
    columns are set to do that."""
    from rich.measure import Measurement

    wide = con.options.update(max_width=10_000)
    least, natural = [], 0
    for col in table.columns:
        cells = [Measurement.get(con, wide, c) for c in col.cells]
        head = Measurement.get(con, wide, col.header)
        most = max([head.maximum, *(c.maximum for c in cells)])
        one_line = max([head.minimum, *(c.maximum for c in cells)])
        prose = max([head.minimum, *(c.minimum for c in cells), min(most, PROSE_WIDTH)])
        least.append(min(most, prose if col.max_width else one_line))
        natural += min(most, col.max_width or most)
    if natural_width(con, table) - natural + sum(least) > con.width:
        return False
    for col, w in zip(table.columns, least):
        col.min_width = w
    return True


def rows_of(table) -> list[list[str]]:
    """A rich Table's cells, row by row, as markup strings."""
    from rich.text import Text

    cols = [[c.markup if isinstance(c, Text) else str(c) for c in col.cells] for col in table.columns]
    return [list(row) for row in zip(*cols)]


def _plain(markup) -> str:
    from rich.text import Text

    text = markup if isinstance(markup, Text) else Text.from_markup(str(markup))
    return " ".join(text.plain.split())


def _packed(pairs: list[str], width: int) -> list[str]:
    """``pairs`` (markup) greedily into lines of at most ``width`` cells; a pair longer than a line has one of its
    own (the console wraps it between words)."""
    lines: list[str] = []
    used = 0
    for p in pairs:
        n = len(_plain(p))
        if lines and used + len(PAIR_GAP) + n <= width:
            lines[-1] += PAIR_GAP + p
            used += len(PAIR_GAP) + n
        else:
            lines.append(p)
            used = n
    return lines
