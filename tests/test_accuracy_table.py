"""The accuracy table a person reads at the end of `kvdiag accuracy` and from `kvdiag report RUN --format table`:
at 80 and 120 columns every kv dtype and task name is whole (kv_recall and kv_recall_long told apart), and a failed
metric that is not the task's primary one is still shown."""

import os
import re
import subprocess
import sys

import pytest

from tests.accuracy_runs import DTYPES, TASKS, recall_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table(run_dir, columns: int) -> str:
    r = subprocess.run([sys.executable, "-m", "kvdiag", "report", str(run_dir), "--format", "table"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": str(columns)},
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def names_whole(text: str, columns: int) -> None:
    words = re.findall(r"[\w.-]+", text)
    assert all(len(line) <= columns for line in text.splitlines()), text
    assert "…" not in text, text
    for name in DTYPES + list(TASKS):
        assert name in words, (name, text)
    assert words.count("kv_recall") >= len(DTYPES) and words.count("kv_recall_long") >= len(DTYPES)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("recall")
    recall_run(d)
    return d


@pytest.mark.parametrize("columns", [80, 120])
def test_report_table_keeps_every_name_whole(run_dir, columns):
    text = table(run_dir, columns)
    names_whole(text, columns)
    row = next(line for line in text.splitlines() if "acc_norm" in line)  # the failed non-primary metric
    assert "kv_recall_long acc_norm" in row and "regression" in row and "-0.300" in row
    if columns == 120:  # wide enough for one row per dtype x task
        assert "fp8_e5m2" in row


def test_narrow_table_heads_each_dtype_once(run_dir):
    lines = table(run_dir, 80).splitlines()
    heads = [line.strip() for line in lines if line.strip() in DTYPES]
    assert heads == DTYPES  # then its tasks below it
