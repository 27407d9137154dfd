"""The accuracy table a person reads at the end of `kvdiag accuracy` and from `kvdiag report RUN --format table`:
at 80 and 120 columns every kv dtype and task name is whole (kv_recall and kv_recall_long told apart), and a failed
metric that is not the task's primary one is still shown."""

import os
import re
import subprocess
import sys

import pytest
from accuracy_runs import DTYPES, TASKS, recall_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


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


def md_rows(md: str, header_cell: str) -> list[list[str]]:
    """The rows of the markdown table whose header has ``header_cell``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and header_cell in line)
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def test_report_write_holds_every_score_with_its_interval_and_change(run_dir):
    from html.parser import HTMLParser

    from scipy import stats

    r = subprocess.run([sys.executable, "-m", "kvdiag", "report", str(run_dir), "--write"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = md_rows((run_dir / "report.md").read_text(), "score 95% CI")
    assert {(x["kv dtype"], x["task"], x["metric"]) for x in rows} == {
        (d, t, m) for d in DTYPES for t in TASKS for m in ("acc", "acc_norm")}
    bad = next(x for x in rows if (x["kv dtype"], x["task"], x["metric"]) == ("fp8_e5m2", "kv_recall_long", "acc_norm"))
    se = (0.4 * 0.6 / 39) ** 0.5  # 16 of 40 right, lm_eval's sample stderr
    lo, hi = (float(v) for v in bad["score 95% CI"].strip("[]").split(","))
    assert float(bad["score"]) == 0.4 and abs(lo - (0.4 - 1.96 * se)) < 1e-3 and abs(hi - (0.4 + 1.96 * se)) < 1e-3
    assert float(bad["Δ vs baseline"]) == -0.3 and bad["verdict"] == "regression"
    assert abs(float(bad["p"]) - stats.binomtest(0, 12, 0.5).pvalue) < 1e-6  # 12 right answers lost, none gained
    assert {x["kv dtype"] for x in md_rows((run_dir / "report.md").read_text(), "KL mean")} == set(DTYPES[1:])

    class Cells(HTMLParser):
        rows: list = []

        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                self.rows.append([])

        def handle_data(self, data):
            if self.rows and self.lasttag in ("td", "th") and data.strip():
                self.rows[-1].append(data)

    html = Cells()
    html.feed((run_dir / "report.html").read_text())
    from kvdiag.checks.accuracy.tables import SCORES

    scored = [row for row in html.rows if len(row) == len(SCORES) and row[0] in DTYPES]
    assert len(scored) == len(rows) and ["fp8_e5m2", "kv_recall_long", "acc_norm", "40", "0.4"] in [
        row[:5] for row in scored]


def test_ci_keeps_a_score_table_per_engine_and_model(run_dir):
    from kvdiag.report.markdown import render_markdown
    from kvdiag.results import load_run

    run = load_run(run_dir)
    a = run.analysis.pop("accuracy")
    run.analysis["accuracy/builtin/tiny-llama"] = a
    run.analysis["accuracy/builtin/gpt2"] = {**a, "rows": [r for r in a["rows"] if r["kv_dtype"] == "auto"]}
    md = render_markdown(run)
    assert "## Accuracy (builtin/tiny-llama) vs baseline 'auto'" in md and "## Accuracy (builtin/gpt2)" in md
    assert len(md_rows(md.split("(builtin/gpt2)")[1], "score 95% CI")) == 4  # auto x 2 tasks x 2 metrics


def test_a_task_longer_than_the_engine_is_scored_with_a_warning_the_table_shows(tmp_path):
    """kv_recall_p450_early's documents (4.0-5.0k tokens) on the shipped tiny-llama (2048 positions): lm_eval cuts
    each context to the engine's length, as its own models do, and the asked key goes with it. The case says so in a
    `truncated` warning, printed under the tables, with the counts (the oracle: the documents' own byte lengths)."""
    import json
    from pathlib import Path

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-d", "auto", "-t", "kv_recall_p450_early",
                        "--limit", "2", "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (case,) = json.loads((out / "run.json").read_text())["cases"]
    (warn,) = [f for f in case["findings"] if f["kind"] == "truncated"]
    docs = [json.loads(x) for x in (Path(ROOT) / "kvdiag" / "tasks" / "data" / "kv_recall_p450_early.jsonl")
            .read_text().splitlines()[:2]]
    longest = max(len(d["context"].encode()) + 1 + max(len(c) for c in d["choices"]) for d in docs)  # BOS + bytes
    assert warn["severity"] == "warning" and warn["evidence"] == {"truncated": 8, "requests": 8, "longest": longest,
                                                                  "max_length": 2048}
    assert "warning (auto): truncated: 8 of 8 lm_eval requests" in " ".join(r.stdout.split())
