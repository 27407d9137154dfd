"""Every command's terminal output at 80 and 120 columns: no line wider than the terminal, nothing cut ("…"), and no
word broken: every word printed is one the same run prints at unlimited width. The oracle is the renderer itself
without a width limit, so a word split across two lines ("unsuppor" / "ted") shows as two words it never prints.
The runs are real runs of each command on the builtin engine, with a fault where one makes a failing row
(tests/data/runs/make.sh writes them)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

RUNS = Path(__file__).resolve().parents[1] / "data" / "runs"
CHECKS = ("accuracy", "dtypes", "memleak", "memleak-kv-sizes", "wake-cycle", "poison", "paths", "selftest", "ci")
WIDTHS = (80, 120)
UNLIMITED = 2000


def run_dir(name: str, tmp_path: Path) -> Path:
    d = tmp_path / "a-run-directory-deeper-than-a-terminal-is-wide" / name  # its path is wider than 80 columns
    d.mkdir(parents=True)
    (d / "run.json").write_text(gzip.decompress((RUNS / f"{name}.json.gz").read_bytes()).decode())
    return d


def printed(monkeypatch, capsys, width: int, draw) -> str:
    """What ``draw()`` prints on a console of ``width`` columns (kvdiag's console reads COLUMNS, as in a shell)."""
    monkeypatch.setenv("COLUMNS", str(width))
    capsys.readouterr()
    draw()
    return capsys.readouterr().out


def words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text))


def assert_reads_at(draw, monkeypatch, capsys, paths: tuple[str, ...] = ()) -> dict[int, str]:
    """``paths`` may each make a line of their own wider than the terminal: a path is printed whole, to be copied."""
    said = {w: printed(monkeypatch, capsys, w, draw) for w in (*WIDTHS, UNLIMITED)}
    whole = words(said[UNLIMITED])
    for w in WIDTHS:
        text = said[w]
        assert text.strip() and "…" not in text, text
        too_wide = [line for line in text.splitlines() if len(line) > w and not line.startswith(paths)]
        assert not too_wide, f"{w} columns:\n" + "\n".join(too_wide)
        assert not words(text) - whole, (w, sorted(words(text) - whole), text)
    return said


@pytest.mark.parametrize("name", CHECKS)
def test_each_commands_table_reads_at_80_and_120_columns(name, tmp_path, monkeypatch, capsys):
    from kvdiag.report.table import print_run
    from kvdiag.results import load_run

    run = load_run(run_dir(name, tmp_path))
    said = assert_reads_at(lambda: print_run(run), monkeypatch, capsys, paths=(run.run_dir,))
    assert run.run_dir in said[UNLIMITED]  # the verdict line was printed: the whole output was compared
    for w in WIDTHS:
        assert run.run_dir in said[w].splitlines()  # the run directory on a line of its own, whole


def test_paths_at_80_columns_folds_each_unsupported_reason_into_one_line_and_notes_the_first_difference(
        tmp_path, monkeypatch, capsys):
    from kvdiag.report.table import print_run
    from kvdiag.results import load_run

    run = load_run(run_dir("paths", tmp_path))
    text = printed(monkeypatch, capsys, 80, lambda: print_run(run))
    quiet = [c for c in run.cases if c.status == "unsupported"]
    reasons = {c.findings[0].message for c in quiet}
    assert quiet and len(reasons) < len(quiet)  # the run has reasons that several rows share
    flat = " ".join(text.split())
    for reason in reasons:
        assert flat.count(reason) == 1, reason
    assert not any(c.id.split("/")[-1] in line for c in quiet for line in text.splitlines() if "│" in line)
    failed = [c for c in run.cases if c.status == "fail"]
    assert failed and all(f"{c.kv_dtype} {c.metrics['path']}: request" in flat for c in failed)  # its note


def test_compare_reads_at_80_and_120_columns(monkeypatch, capsys):
    from kvdiag.render.cells import console
    from kvdiag.report.compare import render_table

    result = json.loads(gzip.decompress((RUNS / "compare.json.gz").read_bytes()))
    assert result["regressed"]  # the faulty run against the clean one: regression rows with their messages
    assert_reads_at(lambda: render_table(result, console()), monkeypatch, capsys)


@pytest.mark.parametrize("args", [("dtypes",), ("selftest", "--list"), ("selftest", "-e", "vllm", "--list")])
def test_listings_read_at_80_and_120_columns(args, monkeypatch, capsys):
    def draw():  # the command in a process of its own, on the COLUMNS printed() set
        r = subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        print(r.stdout, end="")

    assert_reads_at(draw, monkeypatch, capsys)
