"""The paths check's terminal table: one row per kv dtype and path."""

from __future__ import annotations

from kvdiag.render.cells import VERDICTS


def cells(c) -> dict:
    """What the terminal table and report.md/html show of one case (``tables.py`` reads the same; ``floor_by``, the
    kind of run that set the floor, only the reports: the terminal has no room)."""
    from kvdiag.checks.paths.floor import Floor
    from kvdiag.render.cells import fmt_value

    m = c.metrics
    floor = m.get("floor") or {}
    by = {"floor_by": Floor(**floor).setter() if floor else ""}
    if m.get("role") == "reference":  # what the paths of its dtype are held to: its floor
        return {"floor": fmt_value(floor.get("max_dlogprob")), "max": "-", "differ": "-",
                "first": f"reference: {m.get('requests')} prompts, {m.get('tokens')} tokens", "taken": "-", **by}
    if "max_dlogprob" not in m:
        return {"floor": "-", "max": "-", "differ": "-", "first": _first_finding(c), "taken": "-", "floor_by": ""}
    return {**by, "floor": fmt_value(floor.get("max_dlogprob")), "max": fmt_value(m["max_dlogprob"]),
            "differ": f"{m['diverged_requests']}/{m['requests']}",
            "first": first_difference(m) or _first_finding(c) or _also(m),
            "taken": "-" if m.get("counted") is None else str(m["counted"])}


def _also(m: dict) -> str:
    """The sliding window's second comparison where nothing else is said: how many positions it moved."""
    from kvdiag.checks.paths.floor import MOVED_BY
    from kvdiag.checks.paths.sliding import ALONE

    a = m.get(ALONE)
    if not a or "moved_by" not in a:
        return ""
    return f"{ALONE}: {a['moved_by'].get(str(MOVED_BY), 0)}/{a['positions']} positions moved > {MOVED_BY:g}"


def first_difference(m: dict) -> str:
    f = m.get("first_difference")
    if not f:
        return ""
    gap = "" if f.get("margin") is None else f", top-2 gap {f['margin']:.3g}"
    return f"request {f['request']} position {f['position']}: {f['got']} not {f['expected']}{gap}"


def _first_finding(c) -> str:
    said = [x for x in c.findings if x.severity != "info" or c.status not in VERDICTS]
    first = next((x for x in said if x.severity == "error"), said[0] if said else None)
    return first.message[:100] if first else ""


QUIET = ("unsupported", "skipped")  # folded under the table: one line per reason, not a row per path and dtype
TITLE = ("paths per kv dtype: each held to the cold path of the same engine ({what}); |Δ|: a generated token's "
         "logprob, floor: two cold runs and the batch reordered")


def render(run, con) -> None:
    """A row per path that ran (numbers only: long texts go under the table as numbered notes, so no row sets the
    width), then the unsupported paths folded into one line per reason, then the warnings. A terminal too narrow for
    the dtype beside each row gets the dtype as a heading row above its paths."""
    from rich.markup import escape

    from kvdiag.render.cells import warning_lines
    from kvdiag.render.fit import fitting, folded

    ran = [c for c in run.cases if c.status not in QUIET]
    refs = list(dict.fromkeys(cells(c)["first"].removeprefix("reference: ") for c in ran
                              if c.metrics.get("role") == "reference"))
    notes: dict[str, int] = {}
    rows = []
    for c in ran:
        x = cells(c)
        said = "" if c.metrics.get("role") == "reference" else x["first"]
        mark = f" [{notes.setdefault(f'{c.kv_dtype} {path_of(c)}: {said}', len(notes) + 1)}]" if said else ""
        rows.append((c, x, mark))
    title = TITLE.format(what=refs[0] if len(refs) == 1 else "its cold run")
    con.print(fitting(con, lambda: _table(rows, title, False), lambda: _table(rows, title, True)))
    for text, k in notes.items():
        con.print(escape(f"[{k}] {text}"))
    for status in QUIET:
        for line in folded([(path_of(c), c.kv_dtype, _first_finding(c) or "-") for c in run.cases
                            if c.status == status]):
            con.print(escape(f"{status}: {line}"))
    for line in warning_lines([c for c in run.cases if c.status in VERDICTS], ("warning",)):
        con.print(escape(line))


def _table(rows, title: str, grouped: bool):
    """``grouped``: the dtype on a heading row of its own above its paths, one space between columns."""
    from rich import box
    from rich.table import Table

    from kvdiag.render.cells import status_text

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD if grouped else box.HEAVY_HEAD,
              show_edge=not grouped, pad_edge=not grouped, collapse_padding=grouped)
    if not grouped:
        t.add_column("kv dtype", no_wrap=True)
    t.add_column("kv dtype / path" if grouped else "path", no_wrap=True)
    for col in ("floor |Δ|", "max |Δ|", "differ", "taken"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True)
    dtype = None
    for c, x, mark in rows:
        numbers = (x["floor"], x["max"], x["differ"], x["taken"], status_text(c.status) + mark)
        if not grouped:
            t.add_row(c.kv_dtype, path_of(c), *numbers)
            continue
        if c.kv_dtype != dtype:
            dtype = c.kv_dtype
            t.add_row(f"[bold]{dtype}[/]", *[""] * len(numbers))
        t.add_row(f" {path_of(c)}", *numbers)
    return t


def path_of(c) -> str:
    return c.metrics.get("path") or c.params.get("path") or "-"
