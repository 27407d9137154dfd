"""The tables a run prints at its end (and `kvdiag report RUN --format table` again): the check's own view, else
the cases table, then the verdict line."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvdiag.proof.said import print_proofs
from kvdiag.render.cells import cases_table, console, incomplete
from kvdiag.render.fit import show, with_path


def view_for(run) -> Callable | None:
    """The tables the command printed: selftest's matrix, ci's cases and baseline, else the check's own table (its
    registry entry's ``render``) when all the cases are of one check."""
    from kvdiag.checks.registry import get
    if run.analysis.get("selftest"):
        from kvdiag.checks.selftest.view import selftest

        return selftest
    if run.command.split()[1:2] == ["ci"] or run.shard:  # kvdiag ci, or shards of it merged
        return ci
    names = {c.check for c in run.cases}
    check = get(next(iter(names))) if len(names) == 1 else None
    return check.render if check is not None and check.render else None


def print_run(run, render: Callable | None = None) -> None:
    """``render`` (default: the check's own table, else the cases table), then one line: the verdict and counts."""
    con = console()
    render = render or view_for(run)
    if render is not None:
        render(run, con)
    else:
        show(con, cases_table(run.cases), heading=2)
    print_proofs(run, con)
    with_path(con, verdict_line(run), run.run_dir)


def verdict_line(run) -> str:
    """OK or FAILED, and what it rests on: the case counts, or for selftest (whose fault cases are meant to fail)
    the faults caught and the clean engine's state."""
    verdict = "[green]OK[/]" if run.exit_code == 0 else "[red]FAILED[/]"
    a = run.analysis.get("selftest")
    if a:
        faults = a.get("faults", [])
        caught = sum(bool(r.get("caught_by_intended")) for r in faults)
        na = sum(r.get("status") == "not applicable" for r in faults)
        clean = not any(x.get("mark") == "findings" for x in (a.get("clean") or {}).values())
        what = (f"{caught} of {len(faults) - na} {'applicable ' if na else ''}fault(s) caught by their intended check"
                + (f" ({na} not applicable here)" if na else "") + ", the clean engine "
                + ("passed" if clean else "has findings") + f" ({len(run.cases)} cases)")
    else:
        what = ", ".join(f"{n} {k}" for k, n in run.summary.items() if n) or "no cases"
        what += f" ({incomplete(run)})" if incomplete(run) else ""
    return f"{verdict}: {what} — results in"


def ci(run, con) -> None:
    """The cases, then the comparison with the baseline when there is one."""
    from kvdiag.render.cells import cases_table

    show(con, cases_table(run.cases, "kvdiag ci"), heading=2)
    if run.analysis.get("baseline"):
        from kvdiag.report.compare import render_table

        render_table(run.analysis["baseline"], con, title=f"against baseline {run.analysis['baseline']['old']}")
    for name in ("report.md", "report.html", "junit.xml"):
        with_path(con, "wrote", Path(run.run_dir) / name)
