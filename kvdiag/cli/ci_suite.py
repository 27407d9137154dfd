"""Config -> cases: each check's cases come from the same builder its own command uses.

Every (check, engine, model) gives one group of cases; the check's cross-case analysis
(accuracy, dtypes) runs on that group alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.errors import UserError


def _engine_args(settings: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in (settings.get("engine_args") or {}).items()]


def _memleak(s, engine, model, args):
    from kvdiag.cli.memleak_cmd import build_cases

    return build_cases(engine, model, s.get("kv_dtypes"), s.get("device", "auto"), args, None,
                       cycles=s.get("cycles", 3), threshold=s.get("threshold_mib"),
                       max_tokens=s.get("max_tokens", 16)), None


def _wake_cycle(s, engine, model, args):
    from kvdiag.cli.wake_cycle_cmd import build_cases

    return build_cases(engine, model, s.get("kv_dtypes"), s.get("device", "auto"), args, None,
                       levels=s.get("levels"), staged=s.get("staged", False), cycles=s.get("cycles", 5),
                       max_tokens=s.get("max_tokens", 24), logprob_tol=s.get("logprob_tol", 1e-4),
                       seed=s.get("seed", 0), isolate=s.get("isolate", "case")), None


def _poison(s, engine, model, args):
    from kvdiag.cli.poison_cmd import build_cases

    return build_cases(engine, model, s.get("kv_dtypes"), s.get("device", "auto"), args, None,
                       value=s.get("value", "nan"), logprob_tol=s.get("logprob_tol", 1e-4), seed=s.get("seed", 0),
                       isolate=s.get("isolate", "case")), None


def _accuracy(s, engine, model, args):
    from kvdiag.cli.accuracy_cmd import accuracy_cases

    return accuracy_cases(engine, model, s.get("kv_dtypes"), s.get("baseline", "auto"), s.get("tasks"),
                          [Path(p) for p in s.get("include_paths") or ()], s.get("limit"), s.get("num_fewshot"),
                          s.get("seed", 0), args, s.get("device", "auto"), None, s.get("isolate", "case"),
                          max_drop=s.get("max_drop", 0.02), alpha=s.get("alpha", 0.05), max_kl=s.get("max_kl"),
                          min_top1=s.get("min_top1"))


def _dtypes(s, engine, model, args):
    from kvdiag.cli.dtypes_cmd import check_cases

    return check_cases(engine, model, s.get("kv_dtypes"), s.get("device", "auto"), args, None,
                       s.get("isolate", "case"), max_kl=s.get("max_kl"), min_top1=s.get("min_top1"))


BUILDERS = {"memleak": _memleak, "accuracy": _accuracy, "wake-cycle": _wake_cycle, "poison": _poison,
            "dtypes": _dtypes}


def _model(cfg, name: str) -> str | None:
    """The shipped model by its name, a folder relative to the config file, or as given (a hub id)."""
    from kvdiag.cli.common import SHIPPED_MODEL

    if name == SHIPPED_MODEL:
        return None
    near = Path(cfg.resolve(name))
    return str(near) if near.is_dir() else name


def build_suite(cfg) -> tuple[list, list]:
    """(cases, analyzers) of every check the config turns on; a bad value is a ConfigError at its line."""
    from kvdiag.models import label as model_label

    cases, analyzers, seen = [], [], set()
    for chk in cfg.checks:
        s = dict(chk.settings)
        if "include_paths" in s:
            s["include_paths"] = [cfg.resolve(p) for p in s["include_paths"]]
        groups = [(e, m) for e in s.get("engines") or ["builtin"] for m in s.get("models") or [None]]
        for engine, model in groups:
            try:
                got, analyze = BUILDERS[chk.name](s, engine, None if model is None else _model(cfg, model),
                                                  _engine_args(s))
            except UserError as e:
                raise cfg.error(f"[{chk.table}]: {e}", *_blame(chk, s, str(e))) from None
            ids = {c.id for c in got}
            if ids & seen:
                raise cfg.error(f"[{chk.table}]: the same case appears twice: {sorted(ids & seen)[0]}", chk.table)
            seen |= ids
            for c in got:
                c.timeout = s.get("timeout")
                if c.group:  # one shared worker per check, engine and model (labels are unique: ids are)
                    c.group = f"{c.group}/{c.engine}/{model_label(c.model)}"
            cases += got
            if analyze is not None:
                key = chk.name if len(groups) == 1 else f"{chk.name}/{got[0].engine}/{model_label(got[0].model)}"
                analyzers.append(_scoped(analyze, key, ids))
    return cases, analyzers


def _blame(chk, settings: dict, message: str) -> tuple:
    """(table, key) of the setting a builder's error is about: the one whose value the message quotes."""
    table = chk.table
    for key, value in settings.items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, (str, int, float)) and f"'{v}'" in message for v in values):
            return (table, key)
    return (table, None)


def _scoped(analyze, key: str, ids: set):
    """Run a check's cross-case analysis on its own cases only; its results land in run.analysis[key]."""
    def run_it(run):
        from kvdiag.results import RunRecord

        sub = RunRecord(command=run.command, started=run.started, environment=run.environment, run_dir=run.run_dir,
                        cases=[c for c in run.cases if c.id in ids])
        analyze(sub)
        for name, value in sub.analysis.items():
            run.analysis[key if name == key.split("/")[0] else f"{name}:{key}"] = value
    return run_it
