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


def render(run, con) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.render.cells import status_text, warning_lines

    t = Table(title="paths per kv dtype (each held to the cold path of the same engine; floor: two cold runs and "
              "the batch reordered)", title_justify="left")
    for col in ("kv dtype", "path", "floor |Δ|", "max |Δ logprob|", "prompts differ", "first difference",
                "taken", "status"):
        t.add_column(col, justify="left" if col in ("kv dtype", "path", "first difference", "status") else "right",
                     no_wrap=col in ("kv dtype", "path"), overflow="fold")
    for c in run.cases:
        x = cells(c)
        t.add_row(c.kv_dtype, c.metrics.get("path", c.params.get("path", "-")), x["floor"], x["max"], x["differ"],
                  escape(x["first"]), x["taken"], status_text(c.status))
    con.print(t)
    for line in warning_lines([c for c in run.cases if c.status in VERDICTS], ("warning",)):
        con.print(escape(line))
