"""`kvdiag selftest`: an engine, clean and with each of its faults, through the checks; the verdict is a matrix
fault x check. The faults are the engine's own catalogue (``engines.py`` asks its traits: the builtin engine's is
``kvdiag/engines/builtin/selftest.py``, vLLM's ``kvdiag/engines/vllm/selftest.py``); ``plan.py`` selects them and
the checks, ``view.py`` prints the matrix.

Cases are the checks' own case functions with the plan's sizes, run through ``case.py`` (which records
whether each fault fired); one job is (subject, check), the subject being ``clean`` or a fault. Jobs of accuracy
and dtypes are analysed like their commands do (each against its own ``auto`` case). A fault is caught by a check
when it fired in the job's cases (where the engine records firing) and a case of the job reports an error finding
of the kinds the plan names for that check (any error finding where it names none). A fault that did not fire is
``did not fire``, never caught; one that cannot apply to the engine is ``n/a`` with the reason and does not fail
the run. The clean engine must report no error or warning finding at all.
"""

from __future__ import annotations

from kvdiag.checks.registry import get
from kvdiag.checks.selftest import plan
from kvdiag.engines.selftest import Catalogue, Item

CLEAN = "clean"
INCONCLUSIVE = ("timeout", "not_run", "no_baseline")  # error findings that do not show a detection
MAX_DROP, ALPHA = 0.02, 0.05  # accuracy's defaults
CAUGHT, MISSED, NOT_FIRED, NA = "caught", "missed", "did not fire", "n/a"
NOT_APPLICABLE = "not applicable"  # a row's status when the fault cannot apply to this engine


def build_cases(faults: list, checks: list[str], *, device: str = "auto", isolate: str = "run",
                cat: Catalogue | None = None) -> list:
    """Cases of the clean engine first (per check, every item a selected fault runs), then each fault's, with the
    catalogue's engine arguments (``cat``: the engine's catalogue; None: the builtin engine's).

    ``isolate="run"``: one worker per check (and model) for the clean engine and the faults that stay inside an
    engine object, one per fault (and model) for faults that leak into the process; ``"case"``: one per case.
    (Where the engine allows one engine per process on a GPU, vLLM on CUDA, every case gets its own worker whatever
    this says: ``kvdiag.run.scheduling.own_workers``, when the cases run.)
    """
    from kvdiag.assets import TINY_MODEL
    from kvdiag.case import Case
    from kvdiag.checks.selftest.case import TARGET
    from kvdiag.checks.selftest.engines import catalogue

    cat = cat or catalogue("builtin")
    jobs: list[tuple[str, str, list]] = []
    for check in checks:
        wanted = {it.key: it for f in faults for it in f.runs.get(check, ())}
        if wanted:
            jobs.append((CLEAN, check, list(wanted.values())))
    jobs += [(f.name, c, list(f.runs[c])) for f in faults for c in checks if c in f.runs]
    cases = []
    for subject, check, its in jobs:
        if check in plan.COMPARES_TO_BASELINE:
            for model in dict.fromkeys(it.model for it in its):
                if all(it.kv_dtype != plan.BASELINE for it in its if it.model == model):
                    its = [Item(plan.BASELINE, model=model)] + its
        if check == "paths":  # a path run in an engine of its own is judged against its reference case
            from kvdiag.checks.paths.params import with_references

            its = with_references(its)
        leaky = subject != CLEAN and cat.fault(subject).leaves_process_state
        group = None if isolate == "case" else f"selftest/{subject}" if leaky else f"selftest/{check}"
        for it in its:
            # a zoo model's cases in a worker of their own: one model per worker (a case that leaves its process
            # unable to start another engine, vLLM's spec-ngram, gets one of its own: scheduling.own_workers)
            where = group if group is None or it.model is None else f"{group}/{it.model}"
            params = {"device": device, "engine_args": dict(cat.engine_args),
                      "faults": [] if subject == CLEAN else [subject], **get(check).selftest,
                      **cat.sizes.get(check, {}), **it.params, "selftest": subject}
            if check in plan.COMPARES_TO_BASELINE:
                params["role"] = "baseline" if it.kv_dtype == plan.BASELINE else "test"
            cid = f"{check}/{subject}/{it.kv_dtype}" + (f"/{it.suffix}" if it.suffix else "")
            cases.append(Case(check, cat.engine, _model(it.model, TINY_MODEL), it.kv_dtype, TARGET, params=params,
                              id=cid, group=where))
    return cases


def _model(name: str | None, default) -> str:
    """The item's model as the workers take it: the shipped tiny model, or a zoo model's folder."""
    if name is None:
        return str(default)
    from kvdiag.models.zoo import resolve

    return str(resolve(name))


def jobs_of(cases) -> dict[tuple[str, str], list]:
    """The case records by (subject, check), in run order."""
    out: dict[tuple[str, str], list] = {}
    for c in cases:
        out.setdefault((c.params.get("selftest", CLEAN), c.check), []).append(c)
    return out


def analyze(run, faults: list, checks: list[str], not_applicable: dict | None = None,
            engine: str = "builtin", note: str = "") -> None:
    """Judge accuracy/dtypes jobs as their commands do, then fill run.analysis['selftest']. ``not_applicable``: the
    faults not run because they cannot apply to this engine, with the reason; ``note``: the catalogue's, on how its
    cases run."""
    from kvdiag.checks.accuracy import verdict as accuracy
    from kvdiag.checks.dtypes import verdict as dtypes
    from kvdiag.results import RunRecord

    jobs = jobs_of(run.cases)
    analyses = {}  # "check/subject": what accuracy / dtypes --check put in their run.analysis
    for (subject, check), recs in jobs.items():
        own = get(check).analyze  # a check's verdict across its cases (paths: each path against its reference)
        if check not in plan.COMPARES_TO_BASELINE and not own:
            continue
        sub = RunRecord(command=run.command, started=run.started, cases=recs, environment={}, run_dir=run.run_dir)
        if own:  # as its command does, with its default params
            own(sub, get(check).make({}))
            continue
        if check == "accuracy":
            accuracy.analyze(sub, baseline=plan.BASELINE, max_drop=MAX_DROP, alpha=ALPHA)
        else:
            dtypes.analyze(sub)
        analyses[f"{check}/{subject}"] = sub.analysis
    clean = {c: clean_cell(jobs.get((CLEAN, c), [])) for c in checks}
    na = not_applicable or {}
    rows = [fault_row(f, checks, jobs, na.get(f.name)) for f in faults]
    ok = all(c["mark"] != "findings" for c in clean.values()) and all(r["status"] in (CAUGHT, NOT_APPLICABLE)
                                                                      for r in rows)
    run.analysis["selftest"] = {"engine": engine, "checks": list(checks), "clean": clean, "faults": rows, "ok": ok,
                                "analyses": analyses, **({"note": note} if note else {})}


def exit_code(run) -> int:
    return 0 if run.analysis.get("selftest", {}).get("ok") else 1


def detection(recs, kinds: tuple[str, ...] | None = None):
    """The first error finding that shows the check noticed something (of ``kinds`` when given), with its case;
    else None."""
    for rec in recs:
        for f in rec.findings:
            if f.severity == "error" and f.kind not in INCONCLUSIVE and (not kinds or f.kind in kinds) \
                    and not (f.kind == "crashed" and f.evidence.get("stage") == "engine start"):
                return rec, f  # an engine that did not start shows no fault of a later code point
    return None


def clean_cell(recs) -> dict:
    """``findings`` when a clean case did not pass or reported an error finding (the self-test fails);
    ``warnings`` when every case passed and some reported a warning (shown, not failed: vLLM keeps a 64 KiB Triton
    buffer cache for the process's life, which memleak rightly warns of); else ``pass``. accuracy's ``inconclusive``
    is not a warning here: the self-test's documents are few on purpose, and its faults are collapses, not 2-point
    drops."""
    if not recs:
        return {"mark": "-", "cases": []}
    bad = [(r, f) for r in recs for f in r.findings if f.severity == "error"]
    bad += [(r, None) for r in recs if r.status != "pass" and not any(x is r for x, _ in bad)]
    warned = [(r, f) for r in recs for f in r.findings if f.severity == "warning" and f.kind != "inconclusive"]
    shown = bad or warned
    cell = {"mark": "findings" if bad else "warnings" if warned else "pass", "cases": [r.id for r in recs]}
    if shown:
        r, f = shown[0]
        cell["finding"] = _describe(r, f) if f else f"{r.id}: {r.status}"
        cell["count"] = len(shown)
    return cell


def fault_row(f, checks: list[str], jobs: dict, not_applicable: str | None = None) -> dict:
    """One fault's row: a cell per check, whether it fired, and its status: caught (by its intended check), missed,
    did not fire, or not applicable (``not_applicable``: why, decided before the run; else a case's worker found
    its code point absent)."""
    reason = not_applicable or _worker_not_applicable(f, jobs)
    cells = {}
    for check in plan.CHECKS:
        mark = plan.cell_plan(f, check)
        if reason and mark == "run":
            cells[check] = {"mark": NA, "reason": reason}
        elif mark == "run" and check in checks:
            cells[check] = _run_cell(f, check, jobs.get((f.name, check), []))
        elif mark == "n/a":
            cells[check] = {"mark": NA, "reason": plan.na_of(f)[check]}
        else:
            cells[check] = {"mark": "-"}
    intended = cells[f.intended]
    status = NOT_APPLICABLE if reason else intended["mark"] if intended["mark"] in (CAUGHT, NOT_FIRED) else MISSED
    row = {"fault": f.name, "bug_class": f.bug_class, "intended": f.intended, "cells": cells, "status": status,
           "fired": intended.get("fired"), "caught_by_intended": status == CAUGHT}
    if reason:
        row["reason"] = reason
    return row


def _worker_not_applicable(f, jobs: dict) -> str | None:
    """Why a worker found the fault not applicable (its ``metrics["faults"]``), if one did."""
    for c in f.runs:
        for rec in jobs.get((f.name, c), []):
            why = (rec.metrics.get("faults") or {}).get("not_applicable", {}).get(f.name)
            if why:
                return why
    return None


def fired(f, recs) -> int | None:
    """How often the fault's patched code ran in these cases; None when no case recorded it (the engine does not
    record firing). A case whose worker died or hung has no record of its own: the fault marks in its log say
    instead (``runner.fired_marks``, in the crash or timeout finding's evidence), for an engine that records firing."""
    from kvdiag.checks.selftest.case import records_firing

    counts = [(r.metrics.get("faults") or {}).get("fired", {}).get(f.name) for r in recs]
    died = [r for r in recs if "faults" not in r.metrics and records_firing(r.engine)]
    counts += [x.evidence["fired"].get(f.name, 0) for r in died for x in r.findings
               if x.kind in ("crashed", "timeout") and "fired" in x.evidence]
    counts = [c for c in counts if c is not None]
    return sum(counts) if counts else None


def _run_cell(f, check: str, recs) -> dict:
    if not recs:
        return {"mark": "-"}
    kinds = f.kinds.get(check)
    hit, n = detection(recs, kinds), fired(f, recs)
    mark = NOT_FIRED if n == 0 else CAUGHT if hit else MISSED
    cell = {"mark": mark, "cases": [r.id for r in recs], "fired": n}
    if hit:
        cell["case"] = hit[0].id
    if mark == CAUGHT:
        cell["finding"] = _describe(*hit)
    elif mark == NOT_FIRED:
        cell["finding"] = "the fault's patched code never ran in these cases: nothing was shown" + (
            f" (the check reported {_describe(*hit)})" if hit else "")
    else:
        other = detection(recs) if kinds else None
        first = next((x for r in recs for x in r.findings if x.severity != "info"), None)
        cell["finding"] = ("no error finding" + (f" of kind {', '.join(kinds)}" if kinds else "") + ": "
                           + ", ".join(f"{r.kv_dtype} {r.status}" for r in recs)
                           + (f" (it reported {_describe(*other)[:200]})" if other else
                              f" ({first.kind}: {first.message[:120]})" if first else ""))
    return cell


def _describe(rec, f) -> str:
    return f"{rec.kv_dtype}: {f.kind}: {f.message}"
