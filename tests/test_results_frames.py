"""Results as data: a run's scores and per-document samples as pandas DataFrames (kvdiag.results), and
`kvdiag report RUN --format csv / parquet` writing the same rows."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvdiag.results import CaseResult, RunRecord, append_jsonl, cases_frame, samples_frame, scores_frame, write_run_json

ROOT = Path(__file__).resolve().parents[1]


def kvdiag(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def accuracy_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("acc") / "run"
    r = kvdiag("accuracy", "-d", "auto", "-d", "int8", "-t", "kv_recall,kv_recall_long", "--limit", 8, "-o", out,
               "-q")
    assert r.returncode in (0, 1), r.stderr
    return out


@pytest.mark.slow
def test_csv_reads_back_one_row_per_case_task_metric(accuracy_run):
    r = kvdiag("report", accuracy_run, "--format", "csv")
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(io.StringIO(r.stdout))
    run = json.loads((accuracy_run / "run.json").read_text())
    want = {(c["kv_dtype"], t, m, s["score"]) for c in run["cases"] for t, per in c["metrics"]["scores"].items()
            for m, s in per.items()}
    assert len(df) == len(want) == 2 * 2 * 2  # dtypes x tasks x (acc, acc_norm)
    assert {(r.kv_dtype, r.task, r.metric, r.value) for r in df.itertuples()} == want
    rows = {(r["kv_dtype"], r["task"], r["metric"]): r for r in run["analysis"]["accuracy"]["rows"]}
    for r in df.itertuples():
        a = rows[(r.kv_dtype, r.task, r.metric)]
        assert r.verdict == a["verdict"]
        assert (pd.isna(r.delta) and a["delta"] is None) or r.delta == pytest.approx(a["delta"])


@pytest.mark.slow
def test_parquet_holds_the_same_rows(accuracy_run, tmp_path):
    r = kvdiag("report", accuracy_run, "--format", "parquet", "--out", tmp_path / "s.parquet")
    assert r.returncode == 0, r.stderr
    got = pd.read_parquet(tmp_path / "s.parquet")
    pd.testing.assert_frame_equal(got, scores_frame(accuracy_run), check_dtype=False)


@pytest.mark.slow
def test_samples_average_to_lm_evals_scores(accuracy_run):
    """The per-document values, averaged by pandas, are lm_eval's own aggregate scores (an independent sum)."""
    samples = samples_frame(accuracy_run)
    means = samples.groupby(["kv_dtype", "task", "metric"])["value"].agg(["mean", "count"])
    scores = scores_frame(accuracy_run).set_index(["kv_dtype", "task", "metric"])
    assert len(means) == len(scores) == 8
    for key, m in means.iterrows():
        assert m["mean"] == pytest.approx(scores.loc[key, "value"]) and m["count"] == scores.loc[key, "n"] == 8


@pytest.mark.slow
def test_cases_frame_flattens_the_metrics(accuracy_run):
    cases = cases_frame(accuracy_run).set_index("kv_dtype")
    assert list(cases.index) == ["auto", "int8_per_token_head"]  # int8: its alias
    assert cases.loc["auto", "verdict"] == "baseline"
    assert cases.loc["int8_per_token_head", "timings.lm_eval"] > 0 and "scores" not in cases.columns


def test_a_check_without_task_scores_gives_a_row_per_scalar_metric(tmp_path):
    rec = CaseResult("memleak/builtin/tiny/auto", "memleak", "builtin", "tiny", "auto", "fail",
                     metrics={"growth_mib": {"cuda": 32.0}, "cycles": 3, "verdict": "leak", "note": "text"})
    append_jsonl(tmp_path / "results.jsonl", rec)
    write_run_json(tmp_path, RunRecord("kvdiag memleak", "now", [rec], {}))
    df = scores_frame(tmp_path)
    assert sorted(zip(df.metric, df.value)) == [("cycles", 3), ("growth_mib.cuda", 32.0)]
    assert set(df.task) == {""} and set(df.verdict) == {"leak"}
