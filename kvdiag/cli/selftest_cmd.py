"""`kvdiag selftest`: prove every check catches the bug class it exists for, and never cries wolf."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from kvdiag.cli.options import DeviceOpt, Format, FormatOpt, Isolate, JobsOpt, OutputDirOpt, QuietOpt, TimeoutOpt

SelftestFaultOpt = Annotated[Optional[list[str]], typer.Option(
    "--fault", help="Run only these faults (repeat or comma-separate; see --list). Default: all.")]
SelftestCheckOpt = Annotated[Optional[list[str]], typer.Option(
    "--check", "-c", help="Run only these checks: accuracy, dtypes, memleak, wake-cycle, poison (repeat or "
    "comma-separate). Faults whose intended check is left out are not run. Default: all.")]
ListOpt = Annotated[bool, typer.Option("--list", help="List the faults, their bug class and intended check; "
                                                      "run nothing.")]
SelftestIsolateOpt = Annotated[Isolate, typer.Option(
    "--isolate", help="run: one worker per check for the clean engine and the faults that stay inside the "
    "engine object, one per fault for faults that leak into the process (the memleak faults); "
    "case: every case in its own worker (slower).")]


def selftest(
    fault: SelftestFaultOpt = None,
    check: SelftestCheckOpt = None,
    list_faults: ListOpt = False,
    isolate: SelftestIsolateOpt = Isolate.run,
    jobs: JobsOpt = 1,
    device: DeviceOpt = "auto",
    output_dir: OutputDirOpt = None,
    fmt: FormatOpt = Format.table,
    timeout: TimeoutOpt = 300.0,
    quiet: QuietOpt = False,
) -> None:
    """Run the builtin engine clean and with each known bug re-introduced through kvdiag's checks.

    Prints the matrix fault x check: caught (the check reported an error), missed (it ran and
    reported none), n/a (the check cannot observe that fault by design) or - (not run), with the
    finding that caught each fault. The clean engine runs the same cases and must report no error
    or warning. Exit code 0 only when every fault is caught by its intended check and the clean
    engine has no findings; 1 otherwise. Sizes are small (the shipped tiny model, short prompts,
    one or two cycles): a few minutes on two CPU cores.
    """
    from kvdiag.checks import selftest_plan as plan

    faults, checks = plan.select(fault, check)
    if list_faults:
        _list(faults, checks, fmt)
        return
    import os

    from kvdiag.checks import selftest as st
    from kvdiag.run.orchestrate import execute, make_run_dir

    cases = st.build_cases(faults, checks, device=device, isolate=isolate.value)
    run_dir = make_run_dir(output_dir, "selftest")
    # one torch thread per worker (unless the user chose): the tiny model gains nothing from two, and two
    # OpenMP threads on a busy 2-core machine run many times slower
    env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
    raise typer.Exit(execute("selftest", cases, run_dir, fmt=fmt, timeout=timeout, quiet=quiet, jobs=jobs, env=env,
                             analyze=lambda run: st.analyze(run, faults, checks),
                             finish=_judge))


def _judge(run) -> None:
    """Fault cases are meant to fail: the exit code is the selftest's verdict, not the case statuses."""
    from kvdiag.checks import selftest as st

    run.exit_code = st.exit_code(run)


def _list(faults, checks, fmt) -> None:
    from kvdiag.checks import selftest_plan as plan

    rows = [{"fault": f.name, "bug_class": f.bug_class, "intended": f.intended, "also": list(f.also),
             "na": sorted(f.na), "what": f.what} for f in faults]
    if fmt == Format.json:
        typer.echo(json.dumps({"checks": checks, "faults": rows}, indent=2))
        return
    from rich.table import Table

    from kvdiag.report.cells import console

    t = Table(title="kvdiag selftest: builtin faults", title_justify="left")
    for col in ("fault", "class", "intended check", "also run in", "n/a in", "what it breaks"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["fault"], r["bug_class"], r["intended"], ", ".join(r["also"]) or "-", ", ".join(r["na"]) or "-",
                  r["what"])
    console().print(t)
    console().print(f"checks: {', '.join(plan.CHECKS)}")
