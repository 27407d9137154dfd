"""`kvdiag compare OLD NEW`: what regressed between two runs (run directories or baseline files)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvdiag.checks.accuracy import AccuracyParams as A
from kvdiag.cli.accuracy_cmd import AlphaOpt, MaxDropOpt


class CompareFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


CompareFormatOpt = Annotated[CompareFormat, typer.Option(
    "--format", "-f", help="table: for people; json: the comparison on stdout; csv: one row per case x what was "
    "compared (status, each task metric, memory measures) with old, new, delta, test, p-value, 95% interval and "
    "verdict (in Python: kvdiag.report.compare.compare_frame).")]

MemTolOpt = Annotated[Optional[float], typer.Option(
    "--mem-tolerance", help="MiB that memleak's growth per cycle may rise before it is a regression. "
    "Default: the case's own --threshold (16 MiB on CPU). Tensors surviving shutdown may rise by at most "
    "min(this, 1 MiB).", min=0)]


def compare(
    old: Annotated[Path, typer.Argument(help="The earlier run: a run directory or a baseline .json file.",
                                        metavar="OLD")],
    new: Annotated[Path, typer.Argument(help="The later run: a run directory or a baseline .json file.",
                                        metavar="NEW")],
    max_drop: MaxDropOpt = A.max_drop,
    alpha: AlphaOpt = A.alpha,
    mem_tolerance: MemTolOpt = None,
    fmt: CompareFormatOpt = CompareFormat.table,
) -> None:
    """Compare two runs case by case and exit 1 if NEW regressed.

    Regressions: a case that passed and now fails, errors, crashes or times out; an accuracy
    score that dropped by more than --max-drop, significantly at --alpha (paired per-document
    McNemar/bootstrap when both runs kept their samples, else a z-test on the two stderrs);
    memleak growth per cycle or tensors retained after shutdown that rose beyond the tolerance.
    Cases only in one run are listed as new/missing and do not fail the comparison.
    """
    from kvdiag.render.cells import console
    from kvdiag.report.baseline import load_side
    from kvdiag.report.compare import compare as compare_sides
    from kvdiag.report.compare import render_table

    sides = load_side(old), load_side(new)
    unrelated(*sides)
    nothing_compared(*sides)
    result = compare_sides(*sides, max_drop=max_drop, alpha=alpha, mem_tolerance_mib=mem_tolerance)
    if fmt == CompareFormat.json:
        from kvdiag.results import _clean

        typer.echo(json.dumps(_clean(result), indent=2))
    elif fmt == CompareFormat.csv:
        from kvdiag.report.compare import compare_frame

        typer.echo(compare_frame(result).to_csv(index=False), nl=False)
    else:
        render_table(result, console())
    raise typer.Exit(1 if result["regressed"] else 0)


def nothing_compared(old, new) -> None:
    """Accuracy runs of other tasks share their case ids (the dtypes) but no score to compare: bad input too, not
    an empty table that exits 0."""
    from kvdiag.errors import UserError

    def tasks(side) -> set:
        shared = set(old.cases) & set(new.cases)
        return {t for i in shared for t in (side.cases[i].metrics.get("scores") or {})}

    mine, theirs = tasks(old), tasks(new)
    if mine and theirs and not mine & theirs:
        raise UserError(f"OLD and NEW scored other tasks (OLD: {', '.join(sorted(mine))}; NEW: "
                        f"{', '.join(sorted(theirs))}): nothing to compare; give two runs of the same tasks")


def unrelated(old, new) -> None:
    """Two runs without one case id in common (another command, model, engine or dtypes) have nothing to compare:
    bad input, in one line, rather than a table of 'new' and 'missing' that exits 0."""
    from kvdiag.errors import UserError

    if old.cases and new.cases and not set(old.cases) & set(new.cases):
        def what(side) -> str:
            models = sorted({c.model.rstrip("/").rsplit("/", 1)[-1] for c in side.cases.values()})
            return f"'{side.command}' on {', '.join(models)}"

        raise UserError(f"OLD and NEW share no case ({what(old)} vs {what(new)}): nothing to compare; "
                        "give two runs of the same command, engine and model")
