"""The poison check's terminal table: one row per kv dtype."""

from __future__ import annotations

from kvdiag.render.cells import VERDICTS


def render(run, con) -> None:
    """One row per dtype: what was poisoned, what was allocated, and what differed first."""
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.render.cells import status_text, warning_lines
    from kvdiag.render.fit import show

    t = Table(title="poison per kv dtype (reference: the same waves with free blocks zeroed)", title_justify="left")
    for col in ("kv dtype", "value", "fresh blocks", "poisoned blocks", "identical", "NaN", "first difference",
                "status"):
        t.add_column(col, justify="right" if "blocks" in col or col == "NaN" else "left",
                     no_wrap=col == "kv dtype")
    for c in run.cases:
        m = c.metrics
        nan = "-" if "nonfinite_logprobs" not in m else str(m["nonfinite_logprobs"] + m["kv_nonfinite"] +
                                                            m["kv_bad_scales"])
        identical = "-" if "identical" not in m else ("yes" if m["identical"] else "[red]no[/]")
        t.add_row(c.kv_dtype, str(m.get("value", c.params.get("value", "-"))), str(m.get("fresh_blocks", "-")),
                  str(m.get("poisoned_blocks", "-")), identical, nan,
                  escape(_first(c)), status_text(c.status))
    show(con, t)
    for line in warning_lines([c for c in run.cases if c.status in VERDICTS], ("warning", "info")):
        con.print(escape(line))


def _first(c) -> str:
    """Where the poisoned run first differed, else the first finding (a skip's reason, a crash)."""
    f, m = c.metrics.get("first_difference"), c.metrics
    if f:
        return (f"request {f['request']} position {f['position']}: {f['got']} not {f['expected']} "
                f"({m['diverged_requests']}/{m['requests']} requests differ)")
    said = [x for x in c.findings if x.severity != "info" or c.status not in VERDICTS]  # else under the table
    first = next((x for x in said if x.severity == "error"), said[0] if said else None)
    return first.message[:90] if first else ""
