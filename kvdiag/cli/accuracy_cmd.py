"""`kvdiag accuracy`: lm_eval per kv dtype + token-level drift, paired statistics against a baseline dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from kvdiag.checks.accuracy import AccuracyParams
from kvdiag.cli.options import (
    DeviceOpt,
    EngineArgOpt,
    EngineOpt,
    FaultOpt,
    Format,
    FormatOpt,
    Isolate,
    IsolateOpt,
    KVDtypeOpt,
    ModelOpt,
    OutputDirOpt,
    QuietOpt,
    ResumeOpt,
    SeedOpt,
    SweepJobsOpt,
    TimeoutOpt,
    field_option,
)

A = AccuracyParams
TasksOpt = field_option(A, "tasks")
IncludeOpt = field_option(A, "include_paths", list[Path])
BaselineOpt = field_option(A, "baseline")
LimitOpt = field_option(A, "limit")
FewshotOpt = field_option(A, "num_fewshot")
MaxDropOpt = field_option(A, "max_drop")
AlphaOpt = field_option(A, "alpha")
MaxKLOpt = field_option(A, "max_kl")
MinTop1Opt = field_option(A, "min_top1")


LM_EVAL_MODULES = ("kvdiag.lm_eval_adapter", "lm_eval.evaluator")  # what the workers' fork server pre-imports


def accuracy(
    engine: EngineOpt = "builtin",
    model: ModelOpt = None,
    kv_dtype: KVDtypeOpt = None,
    baseline: BaselineOpt = A.baseline,
    tasks: TasksOpt = None,
    include_path: IncludeOpt = None,
    limit: LimitOpt = None,
    num_fewshot: FewshotOpt = None,
    seed: SeedOpt = A.seed,
    max_drop: MaxDropOpt = A.max_drop,
    alpha: AlphaOpt = A.alpha,
    max_kl: MaxKLOpt = None,
    min_top1: MinTop1Opt = None,
    isolate: IsolateOpt = Isolate.case,
    jobs: SweepJobsOpt = None,
    device: DeviceOpt = "auto",
    engine_arg: EngineArgOpt = None,
    output_dir: OutputDirOpt = None,
    fmt: FormatOpt = Format.table,
    timeout: TimeoutOpt = 900.0,
    resume: ResumeOpt = None,
    quiet: QuietOpt = False,
    fault: FaultOpt = None,
) -> None:
    """Score lm_eval tasks and token-level drift for each kv dtype against a baseline dtype.

    Each dtype gets score ± stderr per task metric, the change against the baseline on the
    same documents (exact McNemar for 0/1 metrics, paired bootstrap otherwise) with a 95%
    interval and p-value, and a verdict: ok, regression, collapse or drift. Exit code 1 when
    any dtype regressed, collapsed, drifted or crashed.
    """
    from kvdiag.cli.common import execute, make_run_dir
    from kvdiag.scheduling import case_threads, default_jobs, preload, worker_env

    cases, analyze = accuracy_cases(engine, model, kv_dtype, baseline, tasks, include_path, limit, num_fewshot, seed,
                                    engine_arg, device, fault, isolate, max_drop=max_drop, alpha=alpha, max_kl=max_kl,
                                    min_top1=min_top1)
    run_dir = make_run_dir(output_dir, "accuracy", resume)
    jobs = jobs or default_jobs(cases)
    code = execute("accuracy", cases, run_dir, fmt=fmt, timeout=timeout, resume=resume is not None, quiet=quiet,
                   jobs=jobs, env=worker_env(jobs), preload=preload(cases, *LM_EVAL_MODULES), analyze=analyze,
                   threads=case_threads(cases, isolate, jobs))
    raise typer.Exit(code)


def accuracy_cases(engine, model, kv_dtype, baseline, tasks, include_path, limit, num_fewshot, seed, engine_arg,
                   device, fault, isolate, *, max_drop, alpha, max_kl=None, min_top1=None):
    """(cases, analyze): the accuracy cases, baseline dtype first, and the analysis that judges them against it
    (also used by `kvdiag ci`)."""
    from kvdiag.checks.accuracy import analyze

    sweep = resolve_sweep(engine, model, kv_dtype, baseline, engine_arg, device, fault)
    task_names, need_defaults = _tasks(tasks, include_path)
    params = {"tasks": task_names, "include_paths": [str(p) for p in include_path or ()],
              "include_defaults": need_defaults, "limit": _limit(limit), "num_fewshot": num_fewshot, "seed": seed}
    cases = build_cases("accuracy", "kvdiag.checks.accuracy:run_case", sweep, params, isolate)
    return cases, lambda run: analyze(run, baseline=sweep.baseline, max_drop=max_drop, alpha=alpha, max_kl=max_kl,
                                      min_top1=min_top1)


def _tasks(tasks, include_path) -> tuple[list[str], bool]:
    from kvdiag.errors import UserError
    from kvdiag.tasks import DEFAULT_TASKS

    for p in include_path or ():
        if not Path(p).is_dir():
            raise UserError(f"--include-path '{p}' is not a folder")
    names = [n.strip() for t in tasks or () for n in t.split(",") if n.strip()] or list(DEFAULT_TASKS)
    if not include_path and set(names) <= set(DEFAULT_TASKS):  # kvdiag's own tasks: known without lm_eval's
        return list(dict.fromkeys(names)), False  # task index (importing it costs the run ~1.6 s before any worker)
    from kvdiag.lm_eval_adapter import resolve_tasks

    return resolve_tasks(names, tuple(str(p) for p in include_path or ()))


def _limit(limit: float | None):
    """lm_eval's limit: a number of documents per task (>= 1, whole), or a fraction of each task (0 < limit < 1)."""
    from kvdiag.errors import UserError

    if limit is None:
        return None
    if not 0 < limit < 1 and not (limit >= 1 and float(limit).is_integer()):
        raise UserError(f"--limit {limit:g}: give a number of documents per task (1, 2, ...) or a fraction of "
                        "each task between 0 and 1")
    return int(limit) if limit >= 1 else limit


# ------------------------------------------------------------------ shared with `kvdiag dtypes --check`


@dataclass
class Sweep:
    engine: str
    model: str
    kv_dtypes: list[str]  # the baseline first
    baseline: str
    spec: dict  # EngineSpec fields for case.params


def resolve_sweep(engine, model, kv_dtype, baseline, engine_arg, device, fault, *, all_names=False) -> Sweep:
    """Validate everything a sweep needs before any worker starts (bad input: UserError, exit 2)."""
    from kvdiag import dtypes
    from kvdiag.cli.common import parse_engine_args, resolve_faults, resolve_kv_dtypes, resolve_model
    from kvdiag.engines.base import engine_dtypes, resolve_engine
    from kvdiag.errors import UserError

    engine = resolve_engine(engine)
    engine_args = parse_engine_args(engine_arg)
    model = resolve_model(model)
    valid = engine_dtypes(engine)
    names = resolve_kv_dtypes(engine, kv_dtype) if kv_dtype or not all_names else list(valid)
    try:
        base = dtypes.resolve(baseline, valid, engine)
    except UserError as e:
        raise UserError(f"--baseline: {e}") from None
    spec = {"device": device, "engine_args": engine_args, "faults": resolve_faults(engine, fault)}
    return Sweep(engine, model, [base] + [d for d in names if d != base], base, spec)


def build_cases(check: str, target: str, sweep: Sweep, params: dict, isolate) -> list:
    from kvdiag.models import label
    from kvdiag.runner import Case

    group = check if isolate == Isolate.run else None
    name = label(sweep.model)  # a hub snapshot's repo name, not its commit hash
    return [Case(check, sweep.engine, sweep.model, d, target, group=group, id=f"{check}/{sweep.engine}/{name}/{d}",
                 params={**sweep.spec, **params, "role": "baseline" if d == sweep.baseline else "test"})
            for d in sweep.kv_dtypes]


# ------------------------------------------------------------------ table






