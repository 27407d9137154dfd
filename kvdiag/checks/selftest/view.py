"""`kvdiag selftest`'s matrix: as plain strings for report.md and report.html (``kvdiag/report/score_tables.py``)
and for the terminal, which :func:`selftest` prints (the run's table: ``kvdiag/report/table.py``): a row per fault
(the clean engine first) with whether it fired, a mark per check and its status; what each check reported; the
verdict line."""

from __future__ import annotations

from kvdiag.checks.selftest.plan import CHECKS

MATRIX_TITLE = "selftest{engine}: fault x check (* = intended check)"  # engine: " (NAME)", or "" when unknown


def matrix_title(engine: str | None) -> str:
    """The matrix's title, naming the engine the run recorded (a run.json from before it did names none)."""
    return MATRIX_TITLE.format(engine=f" ({engine})" if engine else "")


REPORTED = ("fault", "check", "result", "finding")


def fired_text(row: dict) -> str:
    """``yes (N)`` (its patched code ran N times), ``no``, ``n/a`` (not applicable), ``-`` (the engine does not
    record firing)."""
    if row.get("status") == "not applicable":
        return "n/a"
    n = row.get("fired")
    return "-" if n is None else f"yes ({n})" if n else "no"


def matrix(a: dict) -> tuple[tuple[str, ...], list[list[str]]]:
    """(header, rows): the clean engine, then each fault with its class, fired, a mark per check (``*``: its
    intended check) and its status."""
    header = ("fault", "class", "fired", *CHECKS, "verdict")
    clean = a["clean"]
    marks = {x["mark"] for x in clean.values()}
    rows = [["clean engine", "-", "-", *[clean.get(c, {"mark": "-"})["mark"] for c in CHECKS],
             "findings" if "findings" in marks else "warnings" if "warnings" in marks else "pass"]]
    for r in a["faults"]:
        rows.append([r["fault"], r["bug_class"], fired_text(r),
                     *[r["cells"][c]["mark"] + ("*" if c == r["intended"] else "") for c in CHECKS],
                     r.get("status") or ("caught" if r.get("caught_by_intended") else "missed")])
    return header, rows


def reported(a: dict) -> list[tuple[str, str, str, str]]:
    """(fault, check, result, finding): the clean engine's findings, the finding behind each caught, missed or not
    fired cell, and, once per fault that cannot apply here, why."""
    clean = a["clean"]
    out = [("clean engine", c, clean[c]["mark"], clean[c]["finding"]) for c in CHECKS
           if clean.get(c, {}).get("finding")]
    for r in a["faults"]:
        if r.get("status") == "not applicable":
            out.append((r["fault"], r["intended"] + "*", "n/a", "not applicable here: " + r.get("reason", "")))
            continue
        for c in CHECKS:
            cell = r["cells"][c]
            if cell["mark"] in ("caught", "missed", "did not fire"):
                out.append((r["fault"], c + ("*" if c == r["intended"] else ""), cell["mark"], cell.get("finding", "")))
    return out


def verdict(a: dict) -> tuple[bool, str]:
    """(ok, what it rests on)."""
    rows = a["faults"]
    by = {s: [r["fault"] for r in rows if _status(r) == s] for s in ("caught", "missed", "did not fire",
                                                                    "not applicable")}
    dirty = [c for c, x in a["clean"].items() if x["mark"] == "findings"]
    na = f", {len(by['not applicable'])} not applicable here" if by["not applicable"] else ""
    if a["ok"]:
        warned = [c for c, x in a["clean"].items() if x["mark"] == "warnings"]
        return True, (f"{len(by['caught'])} fault(s) caught by their intended check{na}; the clean engine has no "
                      + (f"error findings (warnings in: {', '.join(warned)})" if warned else "findings"))
    unproved = [r["fault"] for r in rows if r.get("proof") and not r["proof"]["ok"]]
    parts = ([f"missed by the intended check: {', '.join(by['missed'])}"] if by["missed"] else []) + \
        ([f"not proved outside kvdiag: {', '.join(unproved)}"] if unproved else []) + \
        ([f"did not fire (never counted as caught): {', '.join(by['did not fire'])}"] if by["did not fire"] else []) + \
        ([f"clean engine not clean in: {', '.join(dirty)}"] if dirty else [])
    return False, "; ".join(parts)


def _status(row: dict) -> str:
    return row.get("status") or ("caught" if row.get("caught_by_intended") else "missed")


SELFTEST_STYLE = {"caught": "green", "pass": "green", "missed": "bold red", "findings": "bold red",
                  "warnings": "yellow", "did not fire": "bold red", "n/a": "dim", "not applicable": "dim", "-": "dim"}


def selftest(run, con) -> None:
    """The matrix (intended checks marked *, whether each fault fired), then the finding behind each caught, missed
    or not fired cell, and why each fault that cannot apply here is n/a."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.render.fit import show

    a = run.analysis.get("selftest")
    if not a:
        return
    header, rows = matrix(a)
    t = Table(title=matrix_title(a.get("engine")), title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for col in header:
        t.add_column(col, no_wrap=True)  # names whole at 80 columns: the marks are short
    for i, row in enumerate(rows):
        marks = [_mark(m.rstrip("*"), m.endswith("*")) for m in row[3:-1]]
        t.add_row(row[0], row[1], row[2] if i else "-", *marks, _mark(row[-1]), end_section=i == 0)
    show(con, t, heading=1)
    f = Table(title="what each check reported", title_justify="left")
    for col in ("fault", "check", "result", "finding"):
        f.add_column(col, overflow="fold", max_width=110 if col == "finding" else None)
    for fault, check, mark, finding in reported(a):
        f.add_row(fault, check, _mark(mark), escape(finding[:500]))
    show(con, f, heading=3)
    if a.get("note"):
        con.print(f"[dim]{escape(a['note'])}[/]")
    _proofs(a, con)
    ok, line = verdict(a)
    con.print(("[green]selftest passed[/]: " if ok else "[bold red]selftest failed[/]: ") + escape(line))


def _proofs(a: dict, con) -> None:
    """Each proved fault: whether its reproducer reproduced with the fault's patch and not without (--prove); each
    caught fault without one, why."""
    from rich.markup import escape

    from kvdiag.render.fit import with_path

    proved = [r for r in a["faults"] if r.get("proof")]
    if proved or any(r.get("unproved") for r in a["faults"]):
        con.print("proved outside kvdiag (its reproducer with the fault's patch, then without):")
    for r in proved:
        p = r["proof"]
        said = "proved" if p["ok"] else "[bold red]NOT proved[/]"
        with_path(con, f"  {r['fault']}: exit {p['patched']}, then {p['plain']}: {said}:", f"python3 {p['script']}")
    for r in (r for r in a["faults"] if r.get("unproved")):
        con.print(f"  {r['fault']}: not proved: {escape(r['unproved'])}")


def _mark(mark: str, intended: bool = False) -> str:
    text = mark + ("*" if intended else "")
    style = SELFTEST_STYLE.get(mark, "")
    return f"[{style}]{text}[/]" if style else text
