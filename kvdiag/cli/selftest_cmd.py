"""`kvdiag selftest`: prove every check catches the bug class it exists for, and never cries wolf."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from kvdiag.cli.options import DeviceOpt, Format, FormatOpt, Isolate, OutputDirOpt, QuietOpt, TimeoutOpt

SelftestEngineOpt = Annotated[str, typer.Option(
    "--engine", "-e", help="builtin (its faults are compiled in), vllm (faults patched into the installed vLLM at "
    "the code points of its fixes; those whose code point is absent or that need what the platform lacks are n/a "
    "with the reason), or a plug-in engine whose traits give self-test faults (EngineTraits.selftest).")]

SelftestFaultOpt = Annotated[Optional[list[str]], typer.Option(
    "--fault", help="Run only these faults (repeat or comma-separate; see --list). Default: all.")]
SelftestCheckOpt = Annotated[Optional[list[str]], typer.Option(
    "--check", "-c", help="Run only these checks: accuracy, dtypes, memleak, wake-cycle, poison, paths (repeat "
    "or comma-separate). Faults whose intended check is left out are not run. Default: all.")]
SelftestJobsOpt = Annotated[Optional[int], typer.Option(
    "--jobs", "-j", min=1, help="Cases run at once (each in its own worker). Default: 1 off the GPU; on GPUs one per "
    "visible GPU, or side by side on one where every case is of a check that measures no device memory (-c paths: "
    "each vLLM engine with its own explicit KV cache).")]
ProveFaultsOpt = Annotated[bool, typer.Option(
    "--prove", help="Also prove each caught fault outside kvdiag: its failing case's reproducer (RUN_DIR/repro) "
    "must reproduce with the fault's patch and not without it (two engine starts a fault; memleak, paths, "
    "wake-cycle, poison and dtypes, on vLLM and the builtin engine; a caught fault without one says why).")]
ListOpt = Annotated[bool, typer.Option("--list", help="List the faults, their bug class and intended check; "
                                                      "run nothing.")]
SelftestIsolateOpt = Annotated[Isolate, typer.Option(
    "--isolate", help="run: one worker per check for the clean engine and the faults that stay inside the "
    "engine object, one per fault for faults that leak into the process (the memleak faults); "
    "case: every case in its own worker (slower). vLLM on a GPU: always case (one vLLM engine per process).")]


def selftest(
    engine: SelftestEngineOpt = "builtin",
    fault: SelftestFaultOpt = None,
    check: SelftestCheckOpt = None,
    list_faults: ListOpt = False,
    isolate: SelftestIsolateOpt = Isolate.run,
    jobs: SelftestJobsOpt = None,
    device: DeviceOpt = "auto",
    output_dir: OutputDirOpt = None,
    fmt: FormatOpt = Format.table,
    timeout: TimeoutOpt = 300.0,
    quiet: QuietOpt = False,
    prove: ProveFaultsOpt = False,
) -> None:
    """Run an engine clean and with each known bug re-introduced through kvdiag's checks.

    Prints the matrix fault x check: caught (the fault fired and the check reported its finding),
    missed (it fired and the check reported none), did not fire (the fault's patched code never ran:
    never caught), n/a (the check cannot observe that fault by design, or the fault cannot apply to
    this engine: the reason is shown) or - (not run), with the finding behind each cell. The clean
    engine runs the same cases and must pass with no error finding (a warning is shown, not failed).
    Exit code 0 only when every applicable fault is caught by its intended check and the clean
    engine passed; 1 otherwise. With --prove, each fault caught by a check that writes reproducers
    (memleak, paths, wake-cycle, poison and dtypes, on vLLM and on the builtin engine) must also be
    proved outside kvdiag: its reproducer reproduces with the fault's patch and not without it. Sizes
    are small (the shipped tiny model, short prompts, one or two cycles): a few minutes on two CPU
    cores. vLLM's cases run eager, on a GPU each in a worker of its own (the output says why).
    """
    from kvdiag.checks.selftest import plan

    cat = _catalogue(engine)
    faults, checks = plan.select(fault, check, cat)
    na = {f.name: why for f in faults if (why := plan.not_applicable(f, cat))}
    if list_faults:
        _list(faults, checks, fmt, cat, na)
        return
    import os

    from kvdiag.checks import selftest as st
    from kvdiag.run.orchestrate import execute, make_run_dir
    from kvdiag.run.scheduling import fork_server, gpu_jobs

    cases = st.build_cases([f for f in faults if f.name not in na], checks, device=device, isolate=isolate.value,
                           cat=cat)
    run_dir = make_run_dir(output_dir, "selftest")
    # other engines' workers fork from a server that imported the engine (its traits' preload) and lm_eval once; the
    # faults are applied in each worker, at its engine's start
    modules, env = fork_server(cases) if cat.forked else ((), {})
    # one torch thread per worker (unless the user chose): the tiny model gains nothing from two, and two
    # OpenMP threads on a busy machine with few cores run many times slower
    env = {**env, **({} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"})}
    jobs = gpu_jobs(cases) if jobs is None else jobs  # GPU cases side by side where they may share one
    raise typer.Exit(execute("selftest", cases, run_dir, fmt=fmt, timeout=timeout, quiet=quiet, jobs=jobs, env=env,
                             analyze=lambda run: st.analyze(run, faults, checks, na, cat.engine, cat.note),
                             finish=lambda run: _judge(run, prove and (cat.engine, jobs, quiet)), preload=modules))


def _catalogue(engine: str):
    """The engine's self-test, from its traits (UserError, exit 2, before any worker starts: an engine without one,
    or one whose traits say what it needs that is missing here)."""
    from kvdiag.checks.selftest.engines import catalogue
    from kvdiag.engines.base import resolve_engine

    return catalogue(resolve_engine(engine))


def _judge(run, prove=None) -> None:
    """Fault cases are meant to fail: the exit code is the selftest's verdict, not the case statuses. ``prove``:
    (engine, jobs, quiet) to prove each caught fault's reproducer first (``selftest/proofs.py``)."""
    from kvdiag.checks import selftest as st

    if prove:
        from kvdiag.checks.selftest.proofs import prove_faults

        engine, jobs, quiet = prove
        prove_faults(run, engine, jobs=jobs, say=None if quiet else lambda line: print(line, file=sys.stderr))
    run.exit_code = st.exit_code(run)


def _list(faults, checks, fmt, cat, na: dict) -> None:
    from kvdiag.checks.selftest import plan

    rows = [{"fault": f.name, "bug_class": f.bug_class, "intended": f.intended, "also": list(f.also),
             "na": sorted(plan.na_of(f)), "what": f.what, "not_applicable": na.get(f.name)} for f in faults]
    if fmt == Format.json:
        typer.echo(json.dumps({"engine": cat.engine, "checks": checks, "faults": rows}, indent=2))
        return
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.render.cells import console
    from kvdiag.render.fit import show

    t = Table(title=f"kvdiag selftest: {cat.engine} faults", title_justify="left")
    cols = ("fault", "class", "intended check", "also run in", "n/a in", "what it breaks")
    here = any(r["not_applicable"] for r in rows)
    for col in cols + (("applies here",) if here else ()):
        t.add_column(col, overflow="fold")
    for r in rows:
        cells = [r["fault"], r["bug_class"], r["intended"], ", ".join(r["also"]) or "-", ", ".join(r["na"]) or "-",
                 escape(r["what"])]
        t.add_row(*cells, *([f"[dim]no: {escape(r['not_applicable'])}[/]" if r["not_applicable"] else "yes"]
                            if here else []))
    show(console(), t)
    console().print(f"checks: {', '.join(plan.CHECKS)}")
