"""Terminal tables: one for any run, plus the check-specific parts each command adds."""

from __future__ import annotations

from typing import Callable

STATUS_STYLE = {"pass": "green", "unsupported": "yellow", "skipped": "yellow", "fail": "red", "error": "red",
                "crashed": "bold red", "timeout": "bold red"}


def console(stderr: bool = False):
    """Rich console; when not a terminal (CI logs, pipes) use a wide fixed width instead of 80."""
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(highlight=False, soft_wrap=False, width=width, stderr=stderr)


def fmt_value(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.3e}"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt_value(x) for x in v[:4]) + ("…" if len(v) > 4 else "")
    return "-" if v is None else str(v)


def status_text(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, '')}]{status}[/]"


def cases_table(cases, title: str = "cases", metrics: list[str] | None = None):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("case")
    t.add_column("status")
    for m in metrics or []:
        t.add_column(m, justify="right")
    t.add_column("time", justify="right")
    t.add_column("first finding", overflow="fold", max_width=70)
    for c in cases:
        first = next((f for f in c.findings if f.severity == "error"), c.findings[0] if c.findings else None)
        t.add_row(c.id, status_text(c.status), *[fmt_value(c.metrics.get(m)) for m in metrics or []],
                  f"{c.duration_s:.1f}s", first.message if first else "")
    return t


def view_for(run) -> Callable | None:
    """The tables the command printed: selftest's matrix, ci's cases and baseline, else the check's own table (its
    registry entry's ``render``) when all the cases are of one check."""
    from kvdiag.checks.registry import get, load
    from kvdiag.report import views

    if run.analysis.get("selftest"):
        return views.selftest
    if run.command.split()[1:2] == ["ci"] or run.shard:  # kvdiag ci, or shards of it merged
        return views.ci
    names = {c.check for c in run.cases}
    check = get(next(iter(names))) if len(names) == 1 else None
    return load(check.render) if check is not None and check.render else None


def print_run(run, render: Callable | None = None) -> None:
    """``render`` (default: the check's own table, else the cases table), then one line: the verdict and counts."""
    con = console()
    render = render or view_for(run)
    if render is not None:
        render(run, con)
    else:
        con.print(cases_table(run.cases))
    s = run.summary
    parts = [f"{n} {k}" for k, n in s.items() if n]
    verdict = "[green]OK[/]" if run.exit_code == 0 else "[red]FAILED[/]"
    con.print(f"{verdict}: {', '.join(parts) or 'no cases'} — results in {run.run_dir}")
