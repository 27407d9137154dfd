"""`kvdiag dtypes`: the kv-cache dtypes an engine supports (and, with --check, the support matrix)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvdiag.checks.dtypes import Dtypes
from kvdiag.cli import options as o
from kvdiag.cli.accuracy_cmd import MaxKLOpt, MinTop1Opt

CheckOpt = Annotated[bool, typer.Option(
    "--check", help="Run the support matrix: for each dtype, does the engine start, is a short greedy generation "
    "finite, is an explicit unquantized dtype bit-identical to auto, is drift within bounds, and what its cache "
    "tensors store (element dtype per layer, bytes per token; a warning when a quantized dtype stores layers at "
    "the model's precision). Rows: pass, unsupported, resource (out of device memory, e.g. another engine on the "
    "GPU), crashed, wrong; exit code 1 on resource, crashed or wrong.")]


def dtypes(
    ctx: typer.Context,
    engine: o.EngineOpt = "builtin",
    kv_dtype: o.KVDtypeOpt = None,
    fmt: o.FormatOpt = o.Format.table,
    check: CheckOpt = False,
    model: o.ModelOpt = None,
    device: o.DeviceOpt = "auto",
    engine_arg: o.EngineArgOpt = None,
    max_kl: MaxKLOpt = None,
    min_top1: MinTop1Opt = None,
    isolate: o.IsolateOpt = o.Isolate.case,
    jobs: o.SweepJobsOpt = None,
    output_dir: o.OutputDirOpt = None,
    timeout: o.TimeoutOpt = Dtypes.timeout,
    resume: o.ResumeOpt = None,
    quiet: o.QuietOpt = False,
    prove: o.ProveOpt = True,
    fault: o.FaultOpt = None,
) -> None:
    """List the kv-cache dtypes an engine supports: storage, scale rule, bytes per element.

    With --check, start the engine with every dtype (every name the engine lists, or the
    --kv-dtype ones) against 'auto' and print the support matrix.
    """
    if check:
        raise typer.Exit(_check(engine, kv_dtype, fmt, model, device, engine_arg, max_kl, min_top1, isolate, jobs,
                                output_dir, timeout, resume, quiet, fault, o.given(ctx), prove))
    _list(engine, kv_dtype, fmt)


def _list(engine, kv_dtype, fmt) -> None:
    from kvdiag import dtypes as registry
    from kvdiag.checks.cases import resolve_kv_dtypes
    from kvdiag.engines.base import engine_dtypes, resolve_engine

    engine = resolve_engine(engine)
    names = resolve_kv_dtypes(engine, kv_dtype) if kv_dtype else engine_dtypes(engine)
    rows = []
    for name in names:
        d = registry.get(name)
        rows.append(d.to_json() if d else {"name": name, "storage": "?", "quant": "?", "scale_rule": "(engine-defined)",
                                           "bytes_per_element": None, "same_as": None, "aliases": []})
    if fmt == o.Format.json:
        typer.echo(json.dumps({"engine": engine, "kv_dtypes": rows}, indent=2))
        return
    from rich.table import Table

    from kvdiag.render.cells import console
    from kvdiag.render.fit import show

    t = Table(title=f"kv-cache dtypes of engine '{engine}'", title_justify="left")
    for col in ("name", "storage", "quant", "bytes/elem", "scale rule", "aliases"):
        t.add_column(col, overflow="fold", no_wrap=col == "name")  # a dtype's name is never cut
    for r in rows:
        aliases = ", ".join(r["aliases"]) + (f" (= {r['same_as']})" if r["same_as"] else "")
        t.add_row(r["name"], r["storage"], r["quant"], str(r["bytes_per_element"] or "model"), r["scale_rule"],
                  aliases.strip())
    show(console(), t)


def _check(engine, kv_dtype, fmt, model, device, engine_arg, max_kl, min_top1, isolate, jobs, output_dir, timeout,
           resume, quiet, fault, given, prove) -> int:
    from kvdiag.api import run_check
    from kvdiag.run.orchestrate import command_line

    return run_check("dtypes", engine=engine, model=model, kv_dtypes=kv_dtype, device=device, engine_args=engine_arg,
                     faults=fault, isolate=isolate, output_dir=output_dir, jobs=jobs, timeout=timeout, resume=resume,
                     quiet=quiet, fmt=fmt, prove=prove, command=command_line(), given=given, max_kl=max_kl,
                     min_top1=min_top1).exit_code


