"""The numeric tables of report.md and report.html: each check's own (its registry entry's ``tables``), then a
self-test's matrix. Plain strings, (title, header, rows): markdown.py and html.py each lay them out."""

from __future__ import annotations


def tables(run) -> list[tuple[str, tuple[str, ...], list[list[str]]]]:
    """(title, header, rows) of every table the run's checks supply; none when they supply none."""
    from kvdiag.checks.registry import checks

    out = []
    present = {c.check for c in run.cases} | {key.partition("/")[0] for key in run.analysis}
    for check in checks().values():
        if check.tables and check.name in present:
            out += check.tables(run)
    a = run.analysis.get("selftest")
    if isinstance(a, dict) and a.get("faults") is not None:
        out += _selftest(a)
    return out


def _selftest(a: dict) -> list:
    from kvdiag.checks.selftest.view import REPORTED, matrix, matrix_title, reported, verdict

    header, rows = matrix(a)
    ok, line = verdict(a)
    title = matrix_title(a.get("engine")) + (": passed, " if ok else ": FAILED, ") + line + \
        (f". {a['note']}" if a.get("note") else "")
    return [(title, header, rows), ("selftest: what each check reported", REPORTED, [list(r) for r in reported(a)])]
