"""`kvdiag memleak`, `kvdiag wake-cycle`, `kvdiag poison` and every plug-in check (``kvdiag.checks`` entry point):
a command made from the check's registry entry. The options every check command takes (engine, model, kv dtypes,
jobs, device, ...), the check's own options from its params, its --help from its ``help``; it runs one case per kv
dtype and variant, prints the check's table and exits 0 (all passed or unsupported) or 1."""

from __future__ import annotations

import inspect
from enum import Enum

import typer

from kvdiag.cli import options as o


def common_options(check) -> list[tuple[str, object, object]]:
    """(name, annotation, default) of the options every check command takes."""
    dtypes = o.KVDtypeOpt  # the check's own default, not the engine's sweep:
    if check.kv_dtypes:
        dtypes = o.kv_dtype_option(f"{', '.join(check.kv_dtypes)} (those the engine supports)")
    out = [("engine", o.EngineOpt, "builtin"), ("model", o.ModelOpt, None), ("kv_dtype", dtypes, None),
           ("jobs", o.CheckJobsOpt, None), ("device", o.DeviceOpt, "auto"), ("engine_arg", o.EngineArgOpt, None),
           ("output_dir", o.OutputDirOpt, None), ("fmt", o.FormatOpt, o.Format.table),
           ("timeout", o.TimeoutOpt, check.timeout),
           ("resume", o.ResumeOpt, None), ("quiet", o.QuietOpt, False), ("fault", o.FaultOpt, None)]
    return out + [("prove", o.ProveOpt, True), ("strict", o.StrictOpt, False)]  # every check: a crash has its command


def own_options(check) -> list[tuple[str, object, object]]:
    """(name, annotation, default) of the check's own options: a field with choices becomes an Enum option."""
    from kvdiag.checks.registry import default_of

    out = []
    for f in check.option_fields():
        choices = f.metadata.get("choices")
        default = default_of(f)
        if choices and all(isinstance(c, str) for c in choices):
            kind = Enum(f"{f.name}_choice", {c: c for c in choices}, type=str)
            if isinstance(default, list):  # a repeatable choice (paths --path): its default is the params' own
                out.append((f.name, o.field_option(check.params, f.name, list[kind]), None))
                continue
            out.append((f.name, o.field_option(check.params, f.name, kind), None if default is None else kind(default)))
        else:
            out.append((f.name, o.field_option(check.params, f.name), None if isinstance(default, list) else default))
    return out


def _plain(value):
    """An option's value without its Enum (one, or each of a list)."""
    if isinstance(value, list):
        return [getattr(v, "value", v) for v in value]
    return getattr(value, "value", value)


def command_for(check):
    """A typer command for ``check``, built from its registry entry."""
    common, own = common_options(check), own_options(check)
    names = {n for n, _, _ in common}
    if clash := [n for n, _, _ in own if n in names]:
        raise ValueError(f"check '{check.name}': option {clash[0]} is one every check takes")

    def command(**kw) -> None:
        from kvdiag.api import run_check
        from kvdiag.run.orchestrate import command_line

        values = {n: _plain(kw[n]) for n, _, _ in own if kw[n] is not None}
        run = run_check(check.name, engine=kw["engine"], model=kw["model"], kv_dtypes=kw["kv_dtype"],
                        device=kw["device"], engine_args=kw["engine_arg"], faults=kw["fault"],
                        isolate=kw.get("isolate", "case"), output_dir=kw["output_dir"], jobs=kw["jobs"],
                        timeout=kw["timeout"], resume=kw["resume"], quiet=kw["quiet"], fmt=kw["fmt"],
                        command=command_line(), given=o.given(kw["ctx"]), prove=kw.get("prove", False),
                        strict=kw.get("strict", False), **values)
        raise typer.Exit(run.exit_code)

    isolate = [("isolate", o.CheckIsolateOpt, o.Isolate.case)] if check.isolate else []
    params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
               for n, a, d in common[:3] + own + isolate + common[3:]]
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = check.help
    command.__name__ = check.name.replace("-", "_")
    return command
