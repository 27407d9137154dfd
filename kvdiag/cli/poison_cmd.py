"""`kvdiag poison`: fill free KV blocks with poison; outputs must stay finite and unchanged."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from kvdiag.cli.options import (
    DeviceOpt,
    EngineArgOpt,
    EngineOpt,
    FaultOpt,
    Format,
    FormatOpt,
    Isolate,
    IsolateOpt,
    JobsOpt,
    KVDtypeOpt,
    ModelOpt,
    OutputDirOpt,
    QuietOpt,
    ResumeOpt,
    SeedOpt,
    TimeoutOpt,
)
from kvdiag.cli.wake_cycle_cmd import LogprobTolOpt


class Poison(str, Enum):
    nan = "nan"
    inf = "inf"
    max = "max"
    random = "random"


ValueOpt = Annotated[Poison, typer.Option(
    "--value", help="What free blocks (K, V and scale slots) are filled with: nan, inf (NaN where the dtype has "
    "no inf), max (the dtype's largest finite value) or random (seeded random bits).")]


def poison(
    engine: EngineOpt = "builtin",
    model: ModelOpt = None,
    kv_dtype: KVDtypeOpt = None,
    value: ValueOpt = Poison.nan,
    logprob_tol: LogprobTolOpt = 1e-4,
    seed: SeedOpt = 0,
    isolate: IsolateOpt = Isolate.case,
    jobs: JobsOpt = 1,
    device: DeviceOpt = "auto",
    engine_arg: EngineArgOpt = None,
    output_dir: OutputDirOpt = None,
    fmt: FormatOpt = Format.table,
    timeout: TimeoutOpt = 900.0,
    resume: ResumeOpt = None,
    quiet: QuietOpt = False,
    fault: FaultOpt = None,
) -> None:
    """Poison every free KV block, run a workload that allocates fresh blocks, compare with a clean run.

    Per kv dtype: three waves of requests (decodes growing across block boundaries, short
    requests on freed blocks, all at once) in a cache small enough that freed blocks are
    reused; free blocks are re-poisoned before each wave. The same waves with zeroed free
    blocks are the reference. Any NaN/Inf or changed token fails, naming the request and
    position that first differed. Engines without KV access are reported as skipped.
    """
    from kvdiag.cli.common import execute, make_run_dir

    cases = build_cases(engine, model, kv_dtype, device, engine_arg, fault, value=value.value,
                        logprob_tol=logprob_tol, seed=seed, isolate=isolate)
    run_dir = make_run_dir(output_dir, "poison", resume)
    raise typer.Exit(execute("poison", cases, run_dir, fmt=fmt, timeout=timeout, resume=resume is not None,
                             quiet=quiet, jobs=jobs, render=render))


def build_cases(engine, model, kv_dtype, device, engine_arg, fault, *, value="nan", logprob_tol=1e-4, seed=0,
                isolate="case") -> list:
    """The poison cases, one per dtype (also used by `kvdiag ci`)."""
    from kvdiag.cli.common import dtype_cases

    params = {"value": Poison(value).value, "logprob_tol": logprob_tol}
    return dtype_cases("poison", "kvdiag.checks.poison:run", engine, model, kv_dtype, device, engine_arg, fault,
                       params, seed=seed, isolate=isolate)


def render(run, con) -> None:
    """One row per dtype: what was poisoned, what was allocated, and what differed first."""
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.report.table import status_text

    t = Table(title="poison per kv dtype (reference: the same waves with free blocks zeroed)", title_justify="left")
    for col in ("kv dtype", "value", "fresh blocks", "poisoned blocks", "identical", "NaN", "first difference",
                "status"):
        t.add_column(col, justify="right" if "blocks" in col or col == "NaN" else "left")
    for c in run.cases:
        m = c.metrics
        nan = "-" if "nonfinite_logprobs" not in m else str(m["nonfinite_logprobs"] + m["kv_nonfinite"] +
                                                            m["kv_bad_scales"])
        identical = "-" if "identical" not in m else ("yes" if m["identical"] else "[red]no[/]")
        t.add_row(c.kv_dtype, str(m.get("value", c.params.get("value", "-"))), str(m.get("fresh_blocks", "-")),
                  str(m.get("poisoned_blocks", "-")), identical, nan,
                  escape(_first(c)), status_text(c.status))
    con.print(t)


def _first(c) -> str:
    """Where the poisoned run first differed, else the first finding (a skip's reason, a crash)."""
    f, m = c.metrics.get("first_difference"), c.metrics
    if f:
        return (f"request {f['request']} position {f['position']}: {f['got']} not {f['expected']} "
                f"({m['diverged_requests']}/{m['requests']} requests differ)")
    first = next((x for x in c.findings if x.severity == "error"), c.findings[0] if c.findings else None)
    return first.message[:90] if first else ""
