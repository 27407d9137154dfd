"""Results as data: a run's scores and per-document samples as pandas DataFrames (kvdiag.results), and
`kvdiag report RUN --format csv / parquet` writing the same rows. The run is the README's Python calls, run as
written: `kvdiag.run_check("accuracy", kv_dtypes=["auto", "fp8"], limit=20)`, then the frames of its run directory
(the docs' inventory, test_docs_examples.py, names the test here that holds it to what the README says)."""

import ast
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from doc_examples import find_block

from kvdiag.results import CaseResult, RunRecord, append_jsonl, cases_frame, samples_frame, scores_frame, write_run_json

ROOT = Path(__file__).resolve().parents[2]


def kvdiag(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def capture(code: str) -> str:
    """``code`` with each top-level expression (a doc's ``run.exit_code, run.summary`` line) appended to
    ``_values``, so that a script run as written shows what each line gave."""
    tree = ast.parse(code)
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Expr):
            call = ast.parse("_values.append(None)").body[0]
            call.value.args = [node.value]
            tree.body[i] = call
    return ast.unparse(ast.fix_missing_locations(tree))


NOT_RUN = 'kvdiag.run_check("memleak", engine="vllm"'  # every dtype vLLM lists: test_docs_examples.py says why


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> dict:
    """The README's two Python blocks as one script, in a folder of its own (the run goes to reports/ there), each
    line as written but the vLLM memleak call: `kvdiag.run_check("accuracy", kv_dtypes=["auto", "fp8"], limit=20)`,
    then the three frames of its run directory. {"got": what each line gave, "run_dir", "blocks": the two blocks}."""
    cwd = tmp_path_factory.mktemp("readme")
    calls = find_block("README.md", "import kvdiag")
    first = textwrap.dedent("\n".join(x for x in calls.lines if not x.strip().startswith(NOT_RUN)))
    assert len(first.splitlines()) == len(calls.lines) - 1
    frames_block = find_block("README.md", "from kvdiag.results import")
    frames = textwrap.dedent("\n".join(frames_block.lines))
    assert frames.count('"reports/RUN"') == 3
    script = "\n".join(["_values = []", capture(first), "run_dir = str(run.run_dir)",
                        capture(frames.replace('"reports/RUN"', "run_dir"))])
    script += """
import json
(code, summary), scores, samples, cases = _values
print(json.dumps({"code": code, "summary": summary, "run_dir": run_dir, "scores": [len(scores), list(scores.columns)],
                  "samples": [len(samples), list(samples.columns)], "cases": [len(cases), list(cases.columns)]}))
"""
    r = subprocess.run([sys.executable, "-"], input=script, cwd=cwd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return {"got": got, "run_dir": cwd / got["run_dir"], "cwd": cwd, "frames_block": frames_block}


@pytest.fixture(scope="module")
def accuracy_run(readme_run) -> Path:
    return readme_run["run_dir"]


@pytest.mark.slow
def test_the_readme_python_calls_run_as_written(readme_run):
    """What the README's comments promise: exit code 0 (20 documents cannot see a 2-point drop: fp8 `inconclusive`,
    a pass, with the documents that would settle it), the case counts, report.md and report.html in run.run_dir
    (reports/STAMP-accuracy); scores_frame's case x task x metric rows with the columns its comment names,
    samples_frame's a row a document, cases_frame's a row a case with the flattened metrics its comment names."""
    got, run_dir = readme_run["got"], readme_run["run_dir"]
    assert got["code"] == 0 and got["summary"]["pass"] == 2 and sum(got["summary"].values()) == 2, got
    assert run_dir.parent == readme_run["cwd"] / "reports" and run_dir.name.endswith("-accuracy")
    assert (run_dir / "report.md").is_file() and (run_dir / "report.html").is_file()
    rec = json.loads((run_dir / "run.json").read_text())
    rows = [x for x in rec["analysis"]["accuracy"]["rows"] if x["kv_dtype"] == "fp8"]
    assert rows and all(x["verdict"] == "inconclusive" and x["mdd"] > 0.02 and x["n_needed"] > 20 for x in rows), rows
    (case,) = [c for c in rec["cases"] if c["kv_dtype"] == "fp8"]
    assert case["status"] == "pass" and {f["kind"] for f in case["findings"]} >= {"inconclusive"}

    said = " ".join(" ".join(readme_run["frames_block"].lines).split())
    said_cases = said[said.index("one row per case"):]
    said = said[said.index("case x task x metric:") + len("case x task x metric:"):said.index("; # a crashed")]
    n_scores, columns = got["scores"]
    assert n_scores == 2 * 2 * 2  # case x task (kv_recall, kv_recall_long) x metric (acc, acc_norm)
    named = {x for x in re.split(r"[,/;]\s*|\s+", re.sub(r"\([^)]*\)|#", " ", said)) if x}
    assert named and named <= set(columns) and {"task", "metric"} <= set(columns), (named, columns)
    n_samples, columns = got["samples"]
    assert n_samples == 2 * (20 + 20) * 2 and "doc_id" in columns  # each case's documents, each metric
    n_cases, columns = got["cases"]
    flattened = re.findall(r"\b\w+\.\w+\b", said_cases)
    assert n_cases == 2 and flattened and set(flattened) <= set(columns), (flattened, columns)


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
        assert m["mean"] == pytest.approx(scores.loc[key, "value"]) and m["count"] == scores.loc[key, "n"] == 20


@pytest.mark.slow
def test_cases_frame_flattens_the_metrics(accuracy_run):
    cases = cases_frame(accuracy_run).set_index("kv_dtype")
    assert list(cases.index) == ["auto", "fp8"]
    assert cases.loc["auto", "verdict"] == "baseline"
    assert cases.loc["fp8", "timings.lm_eval"] > 0 and "scores" not in cases.columns


def test_a_check_without_task_scores_gives_a_row_per_scalar_metric(tmp_path):
    rec = CaseResult("memleak/builtin/tiny/auto", "memleak", "builtin", "tiny", "auto", "fail",
                     metrics={"growth_mib": {"cuda": 32.0}, "cycles": 3, "verdict": "leak", "note": "text"})
    append_jsonl(tmp_path / "results.jsonl", rec)
    write_run_json(tmp_path, RunRecord("kvdiag memleak", "now", [rec], {}))
    df = scores_frame(tmp_path)
    assert sorted(zip(df.metric, df.value)) == [("cycles", 3), ("growth_mib.cuda", 32.0)]
    assert set(df.task) == {""} and set(df.verdict) == {"leak"}


def test_a_case_that_did_not_score_is_a_row_with_its_status_and_nan(tmp_path):
    """A crashed or unsupported dtype was left out of scores_frame: a pivot by dtype lost it without a word. Now it
    has the task x metric rows the others scored, value NaN, its status, verdict and why."""
    import torch
    from accuracy_runs import case

    from kvdiag.checks.accuracy import verdict as accuracy

    g = torch.Generator().manual_seed(0)
    dists = [torch.log_softmax(torch.randn(5, 11, generator=g), -1)]
    cases = [case(tmp_path, "auto", dists), case(tmp_path, "bfloat16", dists)]
    crashed = CaseResult("accuracy/builtin/tiny-llama/fp8", "accuracy", "builtin", "/m/tiny-llama", "fp8", "crashed",
                         metrics={"timings": {"startup": 1.5}}, params={"role": "test"})
    crashed.add("error", "worker_died", "worker died in engine start (SIGSEGV)")
    refused = CaseResult("accuracy/builtin/tiny-llama/fp8_e5m2", "accuracy", "builtin", "/m/tiny-llama", "fp8_e5m2",
                         "unsupported", params={"role": "test"})
    refused.add("info", "unsupported", "no attention backend takes fp8_e5m2 here")
    run = RunRecord("kvdiag accuracy", "now", cases + [crashed, refused], {}, run_dir=str(tmp_path))
    accuracy.analyze(run, baseline="auto", max_drop=0.02, alpha=0.05)
    df = scores_frame(run)
    assert list(df.columns[-5:]) == ["mean_kl", "max_kl", "top1_agreement", "verdict", "message"]
    assert "timings.startup" not in set(df.metric)  # a crashed accuracy case's timings are no score
    wide = df.pivot_table(index=["task", "metric"], columns="kv_dtype", values="value", dropna=False)
    assert sorted(wide.columns) == ["auto", "bfloat16", "fp8", "fp8_e5m2"] and len(wide) == 4  # 2 tasks x 2 metrics
    assert wide["fp8"].isna().all() and wide["auto"].notna().all()
    fp8 = df[df.kv_dtype == "fp8"]
    assert len(fp8) == 4 and set(fp8.status) == {"crashed"} and set(fp8.verdict) == {"crashed"}
    assert set(fp8.message) == {"worker died in engine start (SIGSEGV)"} and fp8.value.dtype == float
    e5m2 = df[df.kv_dtype == "fp8_e5m2"]
    assert set(e5m2.status) == {"unsupported"} and set(e5m2.message) == {"no attention backend takes fp8_e5m2 here"}
    assert df[df.kv_dtype == "bfloat16"].message.isna().all()


def test_a_crashed_case_of_a_check_without_scores_still_has_a_row(tmp_path):
    rec = CaseResult("memleak/builtin/tiny/auto", "memleak", "builtin", "tiny", "auto", "crashed")
    rec.add("error", "worker_died", "worker died")
    (row,) = scores_frame(RunRecord("kvdiag memleak", "now", [rec], {})).itertuples()
    assert row.status == "crashed" and row.task == "" and pd.isna(row.value) and row.message == "worker died"
