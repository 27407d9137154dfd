"""`kvdiag wake-cycle`: greedy outputs, KV contents and memory must survive sleep/wake cycles.

Also holds what `kvdiag poison` shares with it: the case sweep and two options.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvdiag.cli.options import (
    CyclesOpt,
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

MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens generated greedily per prompt.")]
LogprobTolOpt = Annotated[float, typer.Option(
    "--logprob-tol", min=0, help="Largest |Δ logprob| allowed where the tokens are identical.")]
LevelOpt = Annotated[Optional[list[int]], typer.Option(
    "--level", "-l", help="Sleep level: 1 (weights offloaded to CPU, KV discarded) or 2 (both discarded); "
    "repeat for both. Default: 1.")]
StagedOpt = Annotated[bool, typer.Option(
    "--staged", help="Wake in two steps, 'weights' then 'kv_cache', instead of all tags at once.")]
# one name for a fault that takes two switches of the builtin engine


def wake_cycle(
    engine: EngineOpt = "builtin",
    model: ModelOpt = None,
    kv_dtype: KVDtypeOpt = None,
    level: LevelOpt = None,
    staged: StagedOpt = False,
    cycles: CyclesOpt = 5,
    max_tokens: MaxTokensOpt = 24,
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
    """Sleep and wake the engine N times per kv dtype; outputs must stay identical.

    Records greedy tokens and logprobs of a fixed prompt set, then each cycle sleeps,
    checks that the KV cache (and at level 2, or on a GPU, the weights) was freed, wakes,
    checks that memory came back, regenerates and compares token for token, and scans the
    KV slots just written for NaN/Inf. Engines without sleep mode are reported as skipped.
    """
    from kvdiag.cli.common import execute, make_run_dir

    cases = build_cases(engine, model, kv_dtype, device, engine_arg, fault, levels=level, staged=staged,
                        cycles=cycles, max_tokens=max_tokens, logprob_tol=logprob_tol, seed=seed, isolate=isolate)
    run_dir = make_run_dir(output_dir, "wake-cycle", resume)
    raise typer.Exit(execute("wake-cycle", cases, run_dir, fmt=fmt, timeout=timeout, resume=resume is not None,
                             quiet=quiet, jobs=jobs, render=render))


def build_cases(engine, model, kv_dtype, device, engine_arg, fault, *, levels=None, staged=False, cycles=5,
                max_tokens=24, logprob_tol=1e-4, seed=0, isolate="case") -> list:
    """The wake-cycle cases, one per dtype and sleep level (also used by `kvdiag ci`)."""
    from kvdiag.cli.common import dtype_cases
    from kvdiag.errors import UserError

    levels = list(dict.fromkeys(levels or [1]))
    if bad := [x for x in levels if x not in (1, 2)]:
        raise UserError(f"--level {bad[0]}: sleep levels are 1 and 2")
    variants = [{"level": lv, "staged": staged, "suffix": f"L{lv}" + ("-staged" if staged else "")} for lv in levels]
    params = {"cycles": cycles, "max_tokens": max_tokens, "logprob_tol": logprob_tol}
    return dtype_cases("wake-cycle", "kvdiag.checks.wake_cycle:run", engine, model, kv_dtype, device, engine_arg,
                       fault, params, seed=seed, isolate=isolate, variants=variants)


def mib(n) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def render(run, con) -> None:
    """Per case the status and first finding, then one row per dtype x cycle."""
    from rich.table import Table

    from kvdiag.report.table import cases_table, fmt_value, status_text

    con.print(cases_table(run.cases, "wake-cycle cases"))
    t = Table(title="wake-cycle per cycle (memory judged on the cache's device)", title_justify="left")
    for col in ("kv dtype", "cycle", "level", "staged", "freed MiB (expected)", "restored", "tokens identical",
                "max |Δ logprob|", "NaN", "verdict"):
        t.add_column(col, justify="left" if col in ("kv dtype", "verdict") else "right")
    for c in run.cases:
        m = c.metrics
        for r in m.get("cycles") or [{}]:
            if not r:
                t.add_row(c.kv_dtype, "-", str(m.get("level", c.params.get("level", "-"))), "-", "-", "-", "-", "-",
                          "-", status_text(c.status))
                continue
            nan = (r.get("nonfinite_logprobs") or 0) + (r.get("kv_nonfinite") or 0) + (r.get("kv_bad_scales") or 0)
            t.add_row(c.kv_dtype, str(r["cycle"]), str(r["level"]), "yes" if r["staged"] else "no",
                      f"{mib(r['freed_bytes'])} ({mib(m.get('expected_bytes'))})",
                      "yes" if r["restored"] else "[red]no[/]", "yes" if r["identical"] else "[red]no[/]",
                      fmt_value(r["max_dlogprob"]), str(nan) if nan else "0",
                      ", ".join(r["problems"]) or "[green]ok[/]")
    con.print(t)
