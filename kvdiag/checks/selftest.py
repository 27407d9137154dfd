"""`kvdiag selftest`: the builtin engine, clean and with each fault, through the checks (plan:
``selftest_plan.py``); the verdict is a matrix fault x check.

Cases are the checks' own case functions with the plan's sizes; one job is (subject, check), the
subject being ``clean`` or a fault. Jobs of accuracy and dtypes are analysed like their commands
do (each against its own ``auto`` case). A fault is caught by a check when a case of its job
reports an error finding; the clean engine must report no error or warning finding at all.
"""

from __future__ import annotations

from kvdiag.checks import selftest_plan as plan
from kvdiag.checks.registry import get

CLEAN = "clean"
INCONCLUSIVE = ("timeout", "not_run", "no_baseline")  # error findings that do not show a detection
MAX_DROP, ALPHA = 0.02, 0.05  # accuracy's defaults


def build_cases(faults: list, checks: list[str], *, device: str = "auto", isolate: str = "run") -> list:
    """Cases of the clean engine first (per check, every item a selected fault runs), then each fault's.

    ``isolate="run"``: one worker per check for the clean engine and the faults that stay inside an
    engine object, one per fault for faults that leak into the process; ``"case"``: one per case.
    """
    from kvdiag.assets import TINY_MODEL
    from kvdiag.case import Case

    model = str(TINY_MODEL)
    jobs: list[tuple[str, str, list]] = []
    for check in checks:
        wanted = {it.key: it for f in faults for it in f.runs.get(check, ())}
        if wanted:
            jobs.append((CLEAN, check, list(wanted.values())))
    jobs += [(f.name, c, list(f.runs[c])) for f in faults for c in checks if c in f.runs]
    cases = []
    for subject, check, its in jobs:
        if check in plan.COMPARES_TO_BASELINE and all(it.kv_dtype != plan.BASELINE for it in its):
            its = [plan.Item(plan.BASELINE)] + its
        leaky = subject != CLEAN and plan.fault(subject).leaves_process_state
        group = None if isolate == "case" else f"selftest/{subject}" if leaky else f"selftest/{check}"
        for it in its:
            params = {"device": device, "engine_args": {}, "faults": [] if subject == CLEAN else [subject],
                      **get(check).selftest, **it.params, "selftest": subject}
            if check in plan.COMPARES_TO_BASELINE:
                params["role"] = "baseline" if it.kv_dtype == plan.BASELINE else "test"
            cid = f"{check}/{subject}/{it.kv_dtype}" + (f"/{it.suffix}" if it.suffix else "")
            cases.append(Case(check, "builtin", model, it.kv_dtype, get(check).target, params=params, id=cid,
                              group=group))
    return cases


def jobs_of(cases) -> dict[tuple[str, str], list]:
    """The case records by (subject, check), in run order."""
    out: dict[tuple[str, str], list] = {}
    for c in cases:
        out.setdefault((c.params.get("selftest", CLEAN), c.check), []).append(c)
    return out


def analyze(run, faults: list, checks: list[str]) -> None:
    """Judge accuracy/dtypes jobs as their commands do, then fill run.analysis['selftest']."""
    from kvdiag.checks import accuracy, dtypes_matrix
    from kvdiag.results import RunRecord

    jobs = jobs_of(run.cases)
    analyses = {}  # "check/subject": what accuracy / dtypes --check put in their run.analysis
    for (subject, check), recs in jobs.items():
        if check not in plan.COMPARES_TO_BASELINE:
            continue
        sub = RunRecord(command=run.command, started=run.started, cases=recs, environment={}, run_dir=run.run_dir)
        if check == "accuracy":
            accuracy.analyze(sub, baseline=plan.BASELINE, max_drop=MAX_DROP, alpha=ALPHA)
        else:
            dtypes_matrix.analyze(sub)
        analyses[f"{check}/{subject}"] = sub.analysis
    clean = {c: clean_cell(jobs.get((CLEAN, c), [])) for c in checks}
    rows = [fault_row(f, checks, jobs) for f in faults]
    ok = all(c["mark"] != "findings" for c in clean.values()) and all(r["caught_by_intended"] for r in rows)
    run.analysis["selftest"] = {"checks": list(checks), "clean": clean, "faults": rows, "ok": ok,
                                "analyses": analyses}


def exit_code(run) -> int:
    return 0 if run.analysis.get("selftest", {}).get("ok") else 1


def detection(recs):
    """The first error finding that shows the check noticed something, with its case; else None."""
    for rec in recs:
        for f in rec.findings:
            if f.severity == "error" and f.kind not in INCONCLUSIVE:
                return rec, f
    return None


def clean_cell(recs) -> dict:
    """``pass`` when every clean case passed with no error or warning finding, else ``findings``."""
    if not recs:
        return {"mark": "-", "cases": []}
    bad = [(r, f) for r in recs for f in r.findings if f.severity in ("error", "warning")]
    bad += [(r, None) for r in recs if r.status != "pass" and not any(x is r for x, _ in bad)]
    cell = {"mark": "findings" if bad else "pass", "cases": [r.id for r in recs]}
    if bad:
        r, f = bad[0]
        cell["finding"] = _describe(r, f) if f else f"{r.id}: {r.status}"
        cell["count"] = len(bad)
    return cell


def fault_row(f, checks: list[str], jobs: dict) -> dict:
    cells = {}
    for check in plan.CHECKS:
        mark = plan.cell_plan(f, check)
        if mark == "run" and check in checks:
            cells[check] = _run_cell(jobs.get((f.name, check), []))
        elif mark == "n/a":
            cells[check] = {"mark": "n/a", "reason": f.na[check]}
        else:
            cells[check] = {"mark": "-"}
    intended = cells[f.intended]
    return {"fault": f.name, "bug_class": f.bug_class, "intended": f.intended, "cells": cells,
            "caught_by_intended": intended["mark"] == "caught"}


def _run_cell(recs) -> dict:
    if not recs:
        return {"mark": "-"}
    hit = detection(recs)
    cell = {"mark": "caught" if hit else "missed", "cases": [r.id for r in recs]}
    if hit:
        cell["finding"] = _describe(*hit)
        cell["case"] = hit[0].id
    else:
        first = next((x for r in recs for x in r.findings if x.severity != "info"), None)
        cell["finding"] = ("no error finding: " + ", ".join(f"{r.kv_dtype} {r.status}" for r in recs)
                           + (f" ({first.kind}: {first.message[:120]})" if first else ""))
    return cell


def _describe(rec, f) -> str:
    return f"{rec.kv_dtype}: {f.kind}: {f.message}"
