"""`kvdiag report RUN_DIR`: re-render any run directory."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer


class ReportFormat(str, Enum):
    md = "md"
    html = "html"
    junit = "junit"
    json = "json"
    table = "table"
    csv = "csv"
    parquet = "parquet"


def report(
    run_dirs: Annotated[list[Path], typer.Argument(
        help="A run directory (holds results.jsonl and run.json); with --merge, the run directories of every shard.",
        metavar="RUN_DIR")],
    fmt: Annotated[ReportFormat, typer.Option(
        "--format", "-f", help="md, html, junit, json, table (the command's own tables), csv (one row per case x "
        "task x metric; in Python: kvdiag.results.scores_frame(RUN_DIR)), or parquet (the same rows; written to "
        "--out, default RUN_DIR/scores.parquet).")]
    = ReportFormat.md,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Write to this file instead of stdout ('-' for stdout). "
        "--write writes report.md, report.html, junit.xml and run.json into RUN_DIR.")] = None,
    write: Annotated[bool, typer.Option("--write", help="Write every report file into RUN_DIR.")] = False,
    merge: Annotated[bool, typer.Option(
        "--merge", help="Merge the runs of `kvdiag ci --shard K/N` into one run in --output-dir: results.jsonl, "
        "run.json, report.md, report.html, junit.xml (runs of different suites: exit 2).")] = False,
    output_dir: Annotated[Optional[Path], typer.Option(
        "--output-dir", "-o", help="With --merge: the merged run's directory.")] = None,
    bug: Annotated[Optional[str], typer.Option(
        "--bug", metavar="CASE", help="An issue body for the engine's tracker about this failing case (its id, as "
        "the run's table names it): environment, expected and actual, its reproducer (RUN_DIR/repro) and output, "
        "the kvdiag command; to stdout or --out.")] = None,
) -> None:
    """Render a finished (or interrupted) run again: as markdown, HTML with plots, JUnit XML, JSON, the
    command's tables, or its scores as CSV or Parquet for pandas, a notebook or a spreadsheet."""
    from kvdiag.errors import UserError
    from kvdiag.report import render, write_reports
    from kvdiag.results import exit_code_for, load_run

    if merge:
        from kvdiag.run.shards import merge as merge_runs

        if output_dir is None:
            raise UserError("--merge needs --output-dir/-o for the merged run")
        run = merge_runs(run_dirs, output_dir)
        for p in write_reports(run, output_dir):
            typer.echo(str(p))
        raise typer.Exit(run.exit_code or 0)
    if len(run_dirs) > 1:
        raise UserError("several run directories: give one, or --merge with -o OUT")
    run_dir = run_dirs[0]
    run = load_run(run_dir)
    if run.exit_code is None:
        run.exit_code = exit_code_for(run.cases)
    if write:
        for p in write_reports(run, run_dir):
            typer.echo(str(p))
        raise typer.Exit(0)
    if bug is not None:
        from kvdiag.report.bug import bug_body

        text = bug_body(run, bug)
    elif fmt == ReportFormat.table:
        from kvdiag.report.table import print_run

        print_run(run)
        raise typer.Exit(0)
    elif fmt == ReportFormat.parquet:
        _parquet(run, out or run_dir / "scores.parquet")
        raise typer.Exit(0)
    elif fmt == ReportFormat.csv:
        from kvdiag.results import scores_frame

        text = scores_frame(run).to_csv(index=False)
    else:
        text = render(run, fmt.value)
    if out is None or str(out) == "-":
        typer.echo(text, nl=False)
    else:
        try:
            out.write_text(text, encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot write '{out}': {e.strerror or e}") from None
        typer.echo(str(out))



def _parquet(run, path: Path) -> None:
    from kvdiag.errors import UserError
    from kvdiag.results import scores_frame

    try:
        import pyarrow  # noqa: F401 - pandas writes parquet through it
    except ImportError:
        raise UserError("--format parquet needs pyarrow (pip install pyarrow); --format csv needs nothing") from None
    try:
        scores_frame(run).to_parquet(path, index=False)
    except OSError as e:
        raise UserError(f"cannot write '{path}': {e.strerror or e}") from None
    typer.echo(str(path))
