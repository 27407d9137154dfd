"""Inputs -> cases, validated before any worker starts (bad input: UserError, exit 2). ``check_cases(name, target,
params)`` is the one entry: a ``Target`` (engine, model, kv dtypes, device, engine arguments, faults, isolation) and
the check's params give one case per kv dtype and variant, or, for accuracy and dtypes --check, a sweep against a
baseline dtype. The commands and `kvdiag ci` build their cases here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvdiag.engines.args import parse_engine_args
from kvdiag.errors import UserError

SHIPPED_MODEL = "tiny-llama"


def default_model() -> str:
    from kvdiag.assets import TINY_MODEL

    return str(TINY_MODEL)


def resolve_model(model: str | None) -> str:
    """The shipped model when None, else a checked local folder: the folder given, or a hub id's snapshot in the
    Hugging Face cache (kvdiag.models). Resolved here, once, so that the workers only see a folder."""
    if model is None:
        return default_model()
    from kvdiag.evaluation.lm_eval_options import refuse_backend
    from kvdiag.models import resolve

    refuse_backend(model)

    return resolve(model)


def engine_model(engine: str, model: str | None) -> str:
    """:func:`resolve_model`, and for the builtin engine the model's architecture checked too, so that a model it
    does not run (a zoo model of another family, say) is one line and exit 2 before any worker starts."""
    folder = resolve_model(model)
    if engine == "builtin" and model is not None:
        from kvdiag.engines.builtin.config import ModelConfig

        try:
            ModelConfig.from_path(folder)
        except UserError as e:
            raise UserError(f"model {model}: {e}") from None
    return folder


def resolve_kv_dtypes(engine: str, user: list[str] | None, *, default_all: bool = True) -> list[str]:
    from kvdiag import dtypes
    from kvdiag.engines.base import engine_dtypes, resolve_engine

    engine = resolve_engine(engine)
    valid = engine_dtypes(engine)
    if not user:
        return dtypes.sweep_names(valid) if default_all else ["auto"]
    out = []
    for u in user:
        for part in u.split(","):
            if part.strip():
                name = dtypes.resolve(part, valid, engine)
                if name not in out:
                    out.append(name)
    return out


def resolve_faults(engine: str, names: list[str] | None) -> list[str]:
    """--fault names for the builtin engine, aliases expanded and validated (UserError otherwise)."""
    if not names:
        return []
    if engine != "builtin":
        raise UserError("--fault works with the builtin engine only")
    from kvdiag.engines.builtin.faults import Faults

    return list(Faults.parse(names).enabled)


@dataclass
class Target:
    """What a check's cases run on, as the user gave it (validated by the builders): the engine, the model (None:
    the shipped one), the kv dtypes (None: every dtype the engine supports), the device, ``key=value`` engine
    arguments, builtin-engine faults, and whether the cases share one worker (``isolate="run"``)."""

    engine: str = "builtin"
    model: str | None = None
    kv_dtypes: list[str] | None = None
    device: str = "auto"
    engine_args: list[str] | None = None
    faults: list[str] | None = None
    isolate: str = "case"

    def __post_init__(self):
        self.isolate = getattr(self.isolate, "value", self.isolate)  # the CLI's Isolate enum


def check_cases(name: str, target: Target, p) -> tuple:
    """(cases, analyze) of a registered check (kvdiag.checks.registry) with params ``p``: the check's own builder
    (``Check.cases``: accuracy, dtypes), else one case per kv dtype and variant, each carrying the options in ``p``;
    ``analyze`` is the check's verdict across cases, or None."""
    from kvdiag.checks.registry import get, load

    check = get(name)
    if check.cases:
        return load(check.cases)(target, p)
    from kvdiag.case import Case
    from kvdiag.engines.base import check_engine_args, resolve_engine
    from kvdiag.models import label as model_label

    engine = resolve_engine(target.engine)
    model = engine_model(engine, target.model)
    base = {"device": target.device, "engine_args": check_engine_args(engine, parse_engine_args(target.engine_args)),
            "faults": resolve_faults(engine, target.faults),
            **{f.name: getattr(p, f.name) for f in check.option_fields()}}
    variants = load(check.variants)(p) if check.variants else ({"suffix": None},)
    group = name if check.isolate and target.isolate == "run" else None
    cases = []
    for d in resolve_kv_dtypes(engine, target.kv_dtypes):
        for v in variants:
            v = dict(v)
            suffix = v.pop("suffix")
            cid = f"{name}/{engine}/{model_label(model)}/{d}" + (f"/{suffix}" if suffix else "")
            cases.append(Case(name, engine, model, d, check.target, params={**base, **v}, id=cid, group=group))
    analyze = (lambda run: load(check.analyze)(run, p)) if check.analyze else None
    return cases, analyze


def accuracy_cases(target: Target, p) -> tuple:
    """(cases, analyze) of ``kvdiag accuracy`` with AccuracyParams ``p``: one case per dtype, the baseline first,
    and the analysis that judges them against it."""
    from kvdiag.checks.accuracy import analyze
    from kvdiag.evaluation.lm_eval_options import lm_eval_params
    from kvdiag.tasks import SHIPPED_TASKS

    sweep = resolve_sweep(target, p.baseline)
    task_names, need_defaults = _tasks(p.tasks, p.include_paths)
    params = {"tasks": task_names, "include_paths": [str(x) for x in p.include_paths or ()],
              "include_defaults": need_defaults, "limit": _limit(p.limit), "num_fewshot": p.num_fewshot, "seed": p.seed,
              **lm_eval_params(p, sweep.model, sweep.spec["engine_args"])}
    if need_defaults or p.include_paths or set(task_names) - set(SHIPPED_TASKS):  # not only kvdiag's own tasks
        from kvdiag.evaluation.lm_eval_adapter import check_tasks_load

        check_tasks_load(task_names, tuple(params["include_paths"]), need_defaults, params.get("metadata"))
    cases = sweep_cases("accuracy", "kvdiag.checks.accuracy:run_case", sweep, params, target.isolate)
    return cases, lambda run: analyze(run, baseline=sweep.baseline, max_drop=p.max_drop, alpha=p.alpha,
                                      max_kl=p.max_kl, min_top1=p.min_top1)


def _tasks(tasks, include_path) -> tuple[list[str], bool]:
    from kvdiag.errors import UserError
    from kvdiag.tasks import DEFAULT_TASKS, SHIPPED_TASKS

    for p in include_path or ():
        if not Path(p).is_dir():
            raise UserError(f"--include-path '{p}' is not a folder")
    names = [n.strip() for t in tasks or () for n in t.split(",") if n.strip()] or list(DEFAULT_TASKS)
    if not include_path and set(names) <= set(SHIPPED_TASKS):  # kvdiag's own tasks: known without lm_eval's
        return list(dict.fromkeys(names)), False  # task index (importing it costs the run ~1.6 s before any worker)
    from kvdiag.evaluation.lm_eval_adapter import resolve_tasks

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


@dataclass
class Sweep:
    engine: str
    model: str
    kv_dtypes: list[str]  # the baseline first
    baseline: str
    spec: dict  # EngineSpec fields for case.params


def resolve_sweep(target: Target, baseline: str, *, all_names=False) -> Sweep:
    """Validate everything a sweep needs before any worker starts (bad input: UserError, exit 2)."""
    from kvdiag import dtypes
    from kvdiag.engines.base import check_engine_args, engine_dtypes, resolve_engine
    from kvdiag.errors import UserError

    engine = resolve_engine(target.engine)
    engine_args = check_engine_args(engine, parse_engine_args(target.engine_args))
    model = engine_model(engine, target.model)
    valid = engine_dtypes(engine)
    names = resolve_kv_dtypes(engine, target.kv_dtypes) if target.kv_dtypes or not all_names else list(valid)
    try:
        base = dtypes.resolve(baseline, valid, engine)
    except UserError as e:
        raise UserError(f"--baseline: {e}") from None
    spec = {"device": target.device, "engine_args": engine_args, "faults": resolve_faults(engine, target.faults)}
    return Sweep(engine, model, [base] + [d for d in names if d != base], base, spec)


def sweep_cases(check: str, target: str, sweep: Sweep, params: dict, isolate) -> list:
    """One case per dtype of the sweep, the baseline first (role 'baseline'), the others 'test'."""
    from kvdiag.case import Case
    from kvdiag.models import label

    group = check if isolate == "run" else None
    name = label(sweep.model)  # a hub snapshot's repo name, not its commit hash
    return [Case(check, sweep.engine, sweep.model, d, target, group=group, id=f"{check}/{sweep.engine}/{name}/{d}",
                 params={**sweep.spec, **params, "role": "baseline" if d == sweep.baseline else "test"})
            for d in sweep.kv_dtypes]


def dtypes_cases(target: Target, p) -> tuple:
    """(cases, analyze) of the support matrix (``kvdiag dtypes --check``) with DtypesParams ``p``: every dtype
    against 'auto'."""
    from kvdiag.checks.dtypes_matrix import analyze

    sweep = resolve_sweep(target, "auto", all_names=True)
    cases = sweep_cases("dtypes", "kvdiag.checks.dtypes_matrix:run_case", sweep, {}, target.isolate)
    return cases, lambda run: analyze(run, max_kl=p.max_kl, min_top1=p.min_top1)
