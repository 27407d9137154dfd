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


def _build(name: str, s: dict, engine: str, model, args) -> tuple:
    """(cases, analyze) of one check for one engine and model, its options from the config (defaults: its params)."""
    from kvdiag.checks.cases import Target
    from kvdiag.checks.registry import check_cases, get

    target = Target(engine, model, s.get("kv_dtypes"), s.get("device", "auto"), args, None, s.get("isolate", "case"))
    return check_cases(name, target, get(name).make(s))


def _model(cfg, name: str) -> str | None:
    """The shipped model by its name, a folder relative to the config file, or as given (a hub id)."""
    from kvdiag.checks.cases import SHIPPED_MODEL

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
                got, analyze = _build(chk.name, s, engine, None if model is None else _model(cfg, model),
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
        values = value if isinstance(value, list) else list(value) if isinstance(value, dict) else [value]
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
    run_it.ids = ids  # the cases it judges together: one shard runs them all (kvdiag.run.shards)
    return run_it
