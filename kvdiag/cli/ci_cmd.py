"""`kvdiag ci`: the checks a config file names, as one run with one exit code and every report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvdiag.cli.options import Format, FormatOpt, OutputDirOpt, ProveOpt, QuietOpt, ResumeOpt

ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", help="TOML config (see docs/ci.md). Default: ./kvdiag.toml, else [tool.kvdiag] in "
    "./pyproject.toml.")]
BaselineOpt = Annotated[Optional[Path], typer.Option(
    "--baseline", help="Compare with this baseline file (or run directory) and exit 1 on a regression. "
    "Default: the config's 'baseline' key.")]
UpdateOpt = Annotated[bool, typer.Option(
    "--update-baseline", help="Write this run as the baseline file (--baseline or the config's 'baseline'); "
    "commit it (outside the run directories, e.g. baselines/). The exit code then ignores the old baseline.")]
ShardOpt = Annotated[Optional[str], typer.Option(
    "--shard", help="K/N: run the K-th of N deterministic shares of the suite (one machine of N: a CI matrix, a Slurm "
    "array), then `kvdiag report --merge` the N run directories. Cases judged together (accuracy's dtypes) stay in "
    "one shard.")]
DurationsOpt = Annotated[Optional[Path], typer.Option(
    "--durations", help="An earlier run directory of this suite: start the longest cases first by its case "
    "durations, so that no long case runs alone at the end; with --shard also balance the shards by them (default: "
    "suite order, shards round robin).")]
JobsOpt = Annotated[Optional[int], typer.Option(
    "--jobs", "-j", min=1, help="Cases run at once (default: the config's 'jobs', else each command's own: on GPUs as "
    "many as share them, one per GPU for memleak, wake-cycle and poison; else 1).")]


def ci(
    config: ConfigOpt = None,
    baseline: BaselineOpt = None,
    update_baseline: UpdateOpt = False,
    output_dir: OutputDirOpt = None,
    jobs: JobsOpt = None,
    shard: ShardOpt = None,
    durations: DurationsOpt = None,
    fmt: FormatOpt = Format.table,
    resume: ResumeOpt = None,
    quiet: QuietOpt = False,
    prove: ProveOpt = True,
) -> None:
    """Run the suite a config file describes: checks x engines x models x kv dtypes, one run directory.

    Writes results.jsonl, run.json, report.md (appended to $GITHUB_STEP_SUMMARY when set),
    report.html (plots) and junit.xml. Exit code 0 when every case passed or was unsupported
    (and nothing regressed against --baseline), 1 otherwise, 2 for a bad config (file:line).

    Config keys: top level engines, models ("tiny-llama" = the shipped model), kv_dtypes, device,
    engine_args, timeout, isolate (defaults for every check), jobs, output_dir, baseline; a table per
    check to run, {tables}, with that command's options (cycles, threshold_mib, tasks, limit, max_drop,
    alpha, levels, value, paths, ...); [compare] max_drop, alpha, mem_tolerance_mib. An unknown key is an
    error that lists the valid ones.
    """
    from kvdiag.ci.config import find_config, load_config
    from kvdiag.ci.suite import build_suite
    from kvdiag.errors import UserError
    from kvdiag.report.baseline import load_side
    from kvdiag.run import shards
    from kvdiag.run.orchestrate import execute
    from kvdiag.run.scheduling import gpu_jobs

    part = shards.parse_shard(shard) if shard is not None else None
    times = shards.durations_of(durations) if durations is not None else None
    cfg = load_config(config or find_config())
    cases, analyzers = build_suite(cfg)
    record = shards.shard_record(cases, part, durations)
    if part is not None:
        cases = shards.select(cases, [a.ids for a in analyzers], part, times)
        mine = {c.id for c in cases}
        analyzers = [a for a in analyzers if a.ids & mine]
    base_path = baseline or (Path(cfg.baseline) if cfg.baseline else None)
    if update_baseline and base_path is None:
        raise UserError("--update-baseline needs --baseline PATH (or 'baseline' in the config)")
    old = None
    if base_path is not None and (not update_baseline or base_path.exists()):
        try:
            old = load_side(base_path)
        except UserError as e:
            raise (cfg.error(str(e), None, "baseline") if baseline is None else e) from None
    if update_baseline:
        _check_writable(base_path)
    run_dir = _run_dir(cfg, output_dir, resume)
    jobs = jobs or cfg.jobs or gpu_jobs(cases)

    def finish(run) -> None:
        from kvdiag.report import write_reports
        from kvdiag.report.baseline import side_of_run, write_baseline
        from kvdiag.report.compare import compare

        if old is not None:
            result = compare(old, side_of_run(run), **cfg.compare)
            run.analysis["baseline"] = result
            if result["regressed"] and not update_baseline:
                run.exit_code = max(run.exit_code or 0, 1)
        if update_baseline:
            run.analysis["baseline_written"] = str(write_baseline(run, base_path))
            if not quiet:
                print(f"kvdiag: wrote baseline {base_path} ({len(run.cases)} cases); commit it", file=sys.stderr)
        run.shard = record
        write_reports(run, run_dir)

    code = execute("ci", cases, run_dir, fmt=fmt, timeout=900.0, resume=resume is not None, quiet=quiet, jobs=jobs,
                   analyze=lambda run: [a(run) for a in analyzers], finish=finish, durations=times, prove=prove)
    raise typer.Exit(code)


def tables_help() -> str:
    """The check tables a config may hold, as ci's --help lists them: every check of the registry."""
    from kvdiag.checks.registry import checks

    return " ".join(f"[{name}]" for name in checks())


ci.__doc__ = ci.__doc__.replace("{tables}", tables_help())


def _run_dir(cfg, output_dir, resume) -> Path:
    from kvdiag.errors import UserError
    from kvdiag.run.orchestrate import make_run_dir

    # the config's output_dir is where a new run goes: --resume RUN_DIR goes on in RUN_DIR (docs/ci.md), only an
    # --output-dir given with it that is not RUN_DIR is refused
    default = Path(cfg.output_dir) if cfg.output_dir and resume is None else None
    try:
        return make_run_dir(output_dir or default, "ci", resume)
    except UserError as e:
        if output_dir is None and resume is None and cfg.output_dir:
            raise cfg.error(str(e), None, "output_dir") from None
        raise


def _check_writable(path: Path) -> None:
    import os

    from kvdiag.errors import UserError

    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write baseline '{path}': {e.strerror or e}") from None
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write baseline '{path}': folder not writable")
