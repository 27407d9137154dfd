"""Inputs -> cases, validated before any worker starts (bad input: UserError, exit 2): the model, engine arguments,
kv dtypes and faults; one case per kv dtype and variant of a registered check (``check_cases``), or a sweep against
a baseline dtype (accuracy, dtypes --check). The commands and `kvdiag ci` build their cases here."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

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
    from kvdiag.models import resolve

    return resolve(model)


def parse_engine_args(items: Iterable[str] | None) -> dict:
    """key=value pairs, values typed as JSON where they parse (2, 0.5, true, null, [..]) else strings. One item may
    hold several, comma-separated as lm_eval's --model_args (``a=1,b=2``), when every part is key=value (a value
    with commas of its own, ``sizes=[1,2]``, stays whole)."""
    out = {}
    for item in (part for given in items or () for part in _split_pairs(given)):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--engine-arg '{item}' is not key=value")
        low = raw.strip()
        try:
            value = json.loads({"True": "true", "False": "false", "None": "null"}.get(low, low))
        except ValueError:
            value = raw
        out[key.strip().replace("-", "_")] = value
    return out


def _split_pairs(item: str) -> list[str]:
    parts = item.split(",")
    keyed = all(re.fullmatch(r"\s*[A-Za-z_][\w-]*\s*=.*", x, re.S) for x in parts)
    return parts if len(parts) > 1 and keyed else [item]


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


def dtype_cases(check, target, engine, model, kv_dtype, device, engine_arg, fault, params, *, seed=None,
                isolate="case", variants=({"suffix": None},)) -> list:
    """One case per kv dtype and variant, validated before any worker starts (bad input: exit 2).

    ``isolate="run"`` puts all cases in one worker; ``seed`` (when given) goes into every case's params.
    """
    from kvdiag.engines.base import resolve_engine
    from kvdiag.models import label as model_label
    from kvdiag.runner import Case

    engine = resolve_engine(engine)
    model = resolve_model(model)
    faults = resolve_faults(engine, fault)
    base = {"device": device, "engine_args": parse_engine_args(engine_arg), "faults": faults, **params}
    if seed is not None:
        base["seed"] = seed
    label = model_label(model)
    group = check if isolate == "run" else None
    cases = []
    for d in resolve_kv_dtypes(engine, kv_dtype):
        for v in variants:
            v = dict(v)
            suffix = v.pop("suffix")
            cid = f"{check}/{engine}/{label}/{d}" + (f"/{suffix}" if suffix else "")
            cases.append(Case(check, engine, model, d, target, params={**base, **v}, id=cid, group=group))
    return cases


def check_cases(name: str, p, engine, model, kv_dtype, device, engine_arg, fault, isolate="case") -> tuple:
    """(cases, analyze) of a registered check (kvdiag.checks.registry): one case per kv dtype and variant, each
    carrying the options in ``p`` (the check's params); ``analyze`` is the check's verdict across cases, or None."""
    from kvdiag.checks.registry import get, load

    check = get(name)
    params = {f.name: getattr(p, f.name) for f in check.option_fields()}
    variants = load(check.variants)(p) if check.variants else ({"suffix": None},)
    isolate = getattr(isolate, "value", isolate) if check.isolate else "case"
    cases = dtype_cases(name, check.target, engine, model, kv_dtype, device, engine_arg, fault, params,
                        isolate=isolate, variants=variants)
    analyze = (lambda run: load(check.analyze)(run, p)) if check.analyze else None
    return cases, analyze


def accuracy_cases(engine, model, kv_dtype, baseline, tasks, include_path, limit, num_fewshot, seed, engine_arg,
                   device, fault, isolate, *, max_drop, alpha, max_kl=None, min_top1=None):
    """(cases, analyze): the accuracy cases, baseline dtype first, and the analysis that judges them against it
    (also used by `kvdiag ci`)."""
    from kvdiag.checks.accuracy import analyze

    sweep = resolve_sweep(engine, model, kv_dtype, baseline, engine_arg, device, fault)
    task_names, need_defaults = _tasks(tasks, include_path)
    params = {"tasks": task_names, "include_paths": [str(p) for p in include_path or ()],
              "include_defaults": need_defaults, "limit": _limit(limit), "num_fewshot": num_fewshot, "seed": seed}
    cases = sweep_cases("accuracy", "kvdiag.checks.accuracy:run_case", sweep, params, isolate)
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


def sweep_cases(check: str, target: str, sweep: Sweep, params: dict, isolate) -> list:
    """One case per dtype of the sweep, the baseline first (role 'baseline'), the others 'test'."""
    from kvdiag.models import label
    from kvdiag.runner import Case

    group = check if getattr(isolate, "value", isolate) == "run" else None
    name = label(sweep.model)  # a hub snapshot's repo name, not its commit hash
    return [Case(check, sweep.engine, sweep.model, d, target, group=group, id=f"{check}/{sweep.engine}/{name}/{d}",
                 params={**sweep.spec, **params, "role": "baseline" if d == sweep.baseline else "test"})
            for d in sweep.kv_dtypes]


def dtypes_cases(engine, model, kv_dtype, device, engine_arg, fault, isolate, *, max_kl=None, min_top1=None):
    """(cases, analyze) of the support matrix (also used by `kvdiag ci`)."""
    from kvdiag.checks.dtypes_matrix import analyze

    sweep = resolve_sweep(engine, model, kv_dtype, "auto", engine_arg, device, fault, all_names=True)
    cases = sweep_cases("dtypes", "kvdiag.checks.dtypes_matrix:run_case", sweep, {}, isolate)
    return cases, lambda run: analyze(run, max_kl=max_kl, min_top1=min_top1)
