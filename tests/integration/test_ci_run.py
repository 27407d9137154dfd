"""`kvdiag ci` end to end: the README's CI command, as written (the repository's suite, kvdiag.toml, against its
committed baseline, baselines/ci-tiny-llama.json; docs/ci.md's GitHub Actions step runs the same), once for every
test here: its outputs, the baseline, `kvdiag compare` on real runs. Planted regressions edit a copy of its records,
or come from a builtin fault (global_kv_list keeps every KV tensor alive: memory grows per cycle).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from doc_examples import BASELINE, ROOT, find_command

from kvdiag.checks.sweep.stats import mean_stderr

DATA = Path(__file__).resolve().parents[1] / "data"
pytestmark = pytest.mark.slow


def kvdiag(*args, env=None, check=None, cwd=None):
    r = subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=900, cwd=cwd)
    if check is not None:
        assert r.returncode == check, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def suite_ids(config: Path) -> set:
    from kvdiag.ci.config import load_config
    from kvdiag.ci.suite import build_suite

    return {c.id for c in build_suite(load_config(config))[0]}


@pytest.fixture(scope="module")
def runs(shipped_suite):
    """The README's CI command, run once for this module and test_paths.py (tests/conftest.py)."""
    return shipped_suite


def test_ci_run_writes_every_output(runs):
    """Exit 0 (nothing regressed against the committed baseline); every output docs/ci.md names; the suite is the
    cases docs/ci.md counts, each in the baseline; report.md appended to the job summary."""
    a, run_dir = runs["a"], runs["A"]
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    n = len(suite_ids(ROOT / "kvdiag.toml"))
    assert a.stdout.strip().splitlines()[-1] == f"OK: {n} pass — results in reports/ci", a.stdout[-2000:]
    for name in ("results.jsonl", "run.json", "report.md", "report.html", "junit.xml"):
        assert (run_dir / name).stat().st_size > 0, name
    run = json.loads((run_dir / "run.json").read_text())
    ids = {c["id"] for c in run["cases"]}
    assert ids == suite_ids(ROOT / "kvdiag.toml")
    ci_md = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    toml = (ROOT / "kvdiag.toml").read_text()
    said = {int(n) for n in re.findall(r"shipped tiny model, (\d+) cases", " ".join(ci_md.split()))}
    said |= {int(n) for n in re.findall(r"^# (\d+) cases, every one held by", toml, re.M)}
    assert said == {len(ids)}, said  # docs/ci.md and kvdiag.toml count the suite's cases
    held = {c["id"] for c in json.loads((ROOT / BASELINE).read_text())["cases"]}
    assert ids <= held
    assert run["exit_code"] == 0 and run["analysis"]["accuracy"]["baseline"] == "auto"
    workers = {c["metrics"]["worker"]["pid"] for c in run["cases"] if c["check"] == "accuracy"}
    assert len(workers) == 1  # isolate = "run": the check's dtypes in one worker
    md = (run_dir / "report.md").read_text()
    assert md.startswith("# kvdiag: passed") and runs["summary"].read_text() == "## earlier step\n" + md
    for cid in ids:
        assert cid in md


def test_report_table_is_what_the_command_printed(runs):
    again = kvdiag("report", "reports/ci", "--format", "table", check=0, cwd=runs["root"])
    assert again.stdout == runs["a"].stdout and "against baseline" in again.stdout, again.stdout


def test_junit_validates_against_the_schema(runs):
    etree = pytest.importorskip("lxml.etree")
    doc = etree.parse(str(runs["A"] / "junit.xml"))
    etree.XMLSchema(etree.parse(str(DATA / "junit.xsd"))).assertValid(doc)
    cases = doc.findall(".//testcase")
    assert len(cases) == len(suite_ids(ROOT / "kvdiag.toml"))
    assert not doc.findall(".//failure") and not doc.findall(".//error")
    assert {s.get("name") for s in doc.findall("testsuite")} == {"kvdiag.memleak", "kvdiag.accuracy",
                                                                  "kvdiag.wake-cycle", "kvdiag.poison", "kvdiag.paths"}


def svgs(html: str) -> list[str]:
    return re.findall(r"<svg .*?</svg>", html, re.S)


def test_html_has_a_plot_for_every_check_and_each_is_valid_svg(runs):
    html = (runs["A"] / "report.html").read_text()
    figures = svgs(html)
    titles = [ET.fromstring(s).find("{http://www.w3.org/2000/svg}title").text for s in figures]  # parses as XML
    for want in ("memleak: process RSS (MiB)", "memleak: live tensors (MiB)", "kv_recall acc per kv dtype",
                 "kv_recall acc: change vs baseline dtype", "drift: mean KL", "wake-cycle level 1: live tensors"):
        assert any(t.startswith(want) for t in titles), (want, titles)
    assert "<script" not in html and "https://" not in html


def test_html_renders_in_headless_chromium(runs, tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.skip("no chromium on this machine")
    page = (runs["A"] / "report.html").resolve().as_uri()
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    r = subprocess.run(flags + ["--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CONSOLE" not in r.stderr and "Uncaught" not in r.stderr, r.stderr[-2000:]
    html = (runs["A"] / "report.html").read_text()
    assert r.stdout.count("<svg") == html.count("<svg") >= 6
    shot = tmp_path / "report.png"
    r = subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,2400", page], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and shot.stat().st_size > 20_000, r.stderr[-2000:]


def test_the_suite_does_not_regress_against_its_committed_baseline(runs):
    """The run against the committed baseline (a run of another day, on another machine): every score compared by
    the paired test on the baseline's samples, nothing regressed; `kvdiag compare BASELINE RUN` (docs/ci.md's merge
    job, on this run) says the same, exit 0."""
    comp = json.loads((runs["A"] / "run.json").read_text())["analysis"]["baseline"]
    assert comp["regressed"] is False and comp["counts"]["regression"] == 0 and comp["counts"]["missing"] == 0
    score_rows = [r for r in comp["rows"] if r["what"] == "kv_recall acc"]
    assert {r["test"] for r in score_rows} == {"mcnemar"} and len(score_rows) == 3  # samples kept: paired
    assert "Against baseline" in (runs["A"] / "report.md").read_text()
    _, merged = find_command("docs/ci.md", "- run: kvdiag report --merge run-*")[0].split(" && ")
    assert merged == f"kvdiag compare {BASELINE} merged", merged
    r = kvdiag("compare", BASELINE, "reports/ci", "--format", "json", cwd=runs["root"], check=0)
    assert json.loads(r.stdout)["regressed"] is False


def plant_score_drop(src: Path, dst: Path, wrong: int) -> None:
    """Copy a run; make fp8 answer `wrong` of its kv_recall documents wrongly (records and samples)."""
    shutil.copytree(src, dst)
    lines = []
    for line in (dst / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["id"] == "accuracy/builtin/tiny-llama/fp8" and "artifacts" in rec["metrics"]:
            samples_path = dst / "artifacts" / rec["metrics"]["artifacts"]["samples"]
            samples = json.loads(samples_path.read_text())
            acc = samples["kv_recall"]["acc"]
            for doc in list(acc)[:wrong]:
                acc[doc] = 0.0
            samples_path.write_text(json.dumps(samples))
            values = list(acc.values())
            rec["metrics"]["scores"]["kv_recall"]["acc"].update(score=sum(values) / len(values),
                                                                stderr=mean_stderr(values))
        lines.append(json.dumps(rec))
    (dst / "results.jsonl").write_text("\n".join(lines) + "\n")
    (dst / "run.json").unlink()


def test_compare_flags_a_planted_score_regression(runs, tmp_path):
    plant_score_drop(runs["A"], tmp_path / "B2", wrong=8)
    r = kvdiag("compare", runs["A"], tmp_path / "B2", "--format", "json", check=1)
    bad = [x for x in json.loads(r.stdout)["rows"] if x["verdict"] == "regression"]
    assert [(x["id"], x["what"], x["test"]) for x in bad] == [
        ("accuracy/builtin/tiny-llama/fp8", "kv_recall acc", "mcnemar")]
    assert bad[0]["delta"] == pytest.approx(-0.8) and bad[0]["p_value"] == pytest.approx(2 / 2 ** 8)
    table = kvdiag("compare", runs["A"], tmp_path / "B2", check=1).stdout
    assert "REGRESSED" in table and "kv_recall acc" in table
    import io

    import pandas as pd

    csv = pd.read_csv(io.StringIO(kvdiag("compare", runs["A"], tmp_path / "B2", "-f", "csv", check=1).stdout))
    assert len(csv) == len(json.loads(r.stdout)["rows"])  # the same rows as json, one per case x what
    (drop,) = csv[csv.verdict == "regression"].itertuples()
    assert (drop.id, drop.what, drop.test) == ("accuracy/builtin/tiny-llama/fp8", "kv_recall acc", "mcnemar")
    assert drop.delta == pytest.approx(-0.8) and drop.p_value == pytest.approx(2 / 2 ** 8)
    # one wrong document out of ten is within --max-drop's reach of noise: not a regression
    plant_score_drop(runs["A"], tmp_path / "B3", wrong=1)
    kvdiag("compare", runs["A"], tmp_path / "B3", check=0)


def test_baseline_file_round_trip(runs, tmp_path):
    base = tmp_path / "baselines" / "ci.json"
    kvdiag("ci", "--config", runs["root"] / "kvdiag.toml", "--resume", runs["A"], "--update-baseline", "--baseline",
           base, "-q", check=0)  # nothing left to run: writes the baseline from the run
    data = json.loads(base.read_text())
    assert data["format"] == "kvdiag-baseline/1" and len(data["cases"]) == len(suite_ids(ROOT / "kvdiag.toml"))
    assert len(data["samples"]) == 3  # the accuracy dtypes'
    kvdiag("compare", base, runs["A"], check=0)
    plant_score_drop(runs["A"], tmp_path / "B2", wrong=8)
    r = kvdiag("ci", "--config", runs["root"] / "kvdiag.toml", "--resume", tmp_path / "B2", "--baseline", base, "-q")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "REGRESSED" in (tmp_path / "B2" / "report.md").read_text()
    data["samples"] = {}  # a baseline without samples: judged with the two stderrs
    base.write_text(json.dumps(data))
    r = kvdiag("compare", base, tmp_path / "B2", "--format", "json", check=1)
    bad = [x for x in json.loads(r.stdout)["rows"] if x["verdict"] == "regression" and x["what"] == "kv_recall acc"]
    assert [x["test"] for x in bad] == ["stderr"] and bad[0]["p_value"] < 0.05


def test_compare_flags_planted_memory_growth(runs, tmp_path):
    r = kvdiag("memleak", "-d", "auto", "-n", "2", "--max-tokens", "4", "--fault", "global_kv_list", "-q",
               "-o", tmp_path / "C")
    assert r.returncode == 1, r.stderr[-2000:]
    r = kvdiag("compare", runs["A"], tmp_path / "C", "--format", "json", check=1)
    rows = json.loads(r.stdout)["rows"]
    bad = {x["what"] for x in rows if x["verdict"] == "regression"}
    assert {"status", "retained tensor MiB", "growth/cycle tensor_bytes MiB"} <= bad, rows
    assert {x["verdict"] for x in rows if x["check"] != "memleak"} == {"missing"}  # not a regression by itself
