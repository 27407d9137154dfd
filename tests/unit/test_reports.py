"""Reports a CI system and a person read: JUnit XML that validates, markdown, self-contained HTML."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.results import RunRecord, exit_code_for, summarize, write_run_json
from kvdiag.run.runner import Case

DATA = Path(__file__).resolve().parents[1] / "data"


def make_run(tmp_path) -> RunRecord:
    def rec(dtype, status, **kw):
        return Case("memleak", "builtin", "/m/tiny", dtype, "x:y").result(status, duration_s=1.5, **kw)

    cases = [rec("auto", "pass", metrics={"retained_mib": 0.0}),
             rec("fp8", "fail", metrics={"retained_mib": 12.5}),
             rec("int8_per_token_head", "crashed", log_tail="Fatal Python error: Segmentation fault <&>"),
             rec("float16", "skipped")]
    cases[1].add("error", "tensor_survived", "3 tensors (12.5 MiB) held by module global x.CACHE", bytes=13107200)
    cases[2].add("error", "crashed", "worker died with SIGSEGV", signal="SIGSEGV")
    cases[3].add("info", "unsupported", "sleep mode is not supported on this platform")
    run = RunRecord(command="kvdiag memleak", started="2026-11-22T05:00:00+00:00", cases=cases,
                    environment={"kvdiag": "0.1.0", "torch": "2.13.0", "device": "cpu", "hostname": "h"},
                    run_dir=str(tmp_path), finished="2026-11-22T05:01:00+00:00")
    run.summary, run.exit_code = summarize(cases), exit_code_for(cases)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(c.to_json()) + "\n" for c in cases))
    write_run_json(tmp_path, run)
    return run


def test_junit_validates_and_carries_findings_and_logs(tmp_path):
    etree = pytest.importorskip("lxml.etree")
    from kvdiag.report.junit import render_junit

    xml = render_junit(make_run(tmp_path))
    schema = etree.XMLSchema(etree.parse(str(DATA / "junit.xsd")))
    doc = etree.fromstring(xml.encode())
    schema.assertValid(doc)
    suite = doc.find("testsuite")
    counts = (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped"))
    assert counts == ("4", "1", "1", "1")
    cases = {tc.get("name"): tc for tc in suite.iter("testcase")}
    fail = cases["memleak/builtin/tiny/fp8"].find("failure")
    assert fail.get("type") == "tensor_survived" and "module global x.CACHE" in fail.text
    err = cases["memleak/builtin/tiny/int8_per_token_head"].find("error")
    assert err.get("type") == "crashed" and "Segmentation fault <&>" in err.text
    assert cases["memleak/builtin/tiny/float16"].find("skipped") is not None
    assert cases["memleak/builtin/tiny/auto"].find("failure") is None


def test_markdown_summary_and_step_summary(tmp_path, monkeypatch):
    from kvdiag.report import write_reports

    run = make_run(tmp_path)
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    paths = write_reports(run, tmp_path)
    assert sorted(p.name for p in paths) == ["junit.xml", "report.html", "report.md", "run.json"]
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# kvdiag: FAILED")
    assert "| memleak/builtin/tiny/fp8 | ❌ fail |" in md and "module global x.CACHE" in md
    assert summary.read_text() == "earlier step\n" + md


def test_html_is_self_contained(tmp_path):
    from kvdiag.report.html import render_html

    html = render_html(make_run(tmp_path))
    assert html.startswith("<!doctype html>") and html.rstrip().endswith("</html>")
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "Segmentation fault &lt;&amp;&gt;" in html  # log text escaped


def test_report_command_rerenders_a_run_dir(tmp_path):
    make_run(tmp_path)
    r = subprocess.run([sys.executable, "-m", "kvdiag", "report", str(tmp_path), "--format", "junit"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("<?xml")
    r = subprocess.run([sys.executable, "-m", "kvdiag", "report", str(tmp_path / "missing")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not found" in r.stderr


def test_memleak_lines_of_equal_dtypes_stay_visible(tmp_path):
    import re

    from kvdiag.checks.memleak.plots import plots as memleak_plots

    dtypes = ["auto", "bfloat16", "float16", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"]
    snaps = [{"cycle": c, "stage": s, "rss_mib": 100.0} for c in range(3) for s in ("after-start", "after-shutdown")]
    cases = [Case("memleak", "builtin", "/m/tiny", d, "x:y").result("pass", metrics={"snapshots": snaps})
             for d in dtypes]
    svg = memleak_plots(cases)[0]
    lines = {name: d for d, name in re.findall(r'<path d="([^"]+)"[^>]*data-series="([^"]+)"', svg)}
    assert sorted(lines) == sorted(dtypes)
    assert len({d.split()[0] for d in lines.values()}) == len(dtypes)  # no line drawn on top of another
    for d in dtypes:  # every dtype's markers are there
        assert svg.count(f"<title>{d}: 100</title>") == len(snaps)


def test_junit_says_an_inconclusive_pass_in_its_testcase(tmp_path):
    """A CI log that reads only JUnit must see that a pass could not have seen --max-drop (issue 48)."""
    etree = pytest.importorskip("lxml.etree")
    from kvdiag.report.junit import render_junit

    run = make_run(tmp_path)
    ok = next(c for c in run.cases if c.status == "pass")
    ok.metrics["verdict"] = "inconclusive"
    ok.add("warning", "inconclusive", "kv_recall acc: could not have seen a drop of 0.02; about 391 documents would")
    doc = etree.fromstring(render_junit(run).encode())
    etree.XMLSchema(etree.parse(str(DATA / "junit.xsd"))).assertValid(doc)
    tc = next(t for t in doc.iter("testcase") if t.get("name") == ok.id)
    assert tc.find("failure") is None and tc.find("error") is None  # still a pass
    head = tc.find("system-out").text.splitlines()[:2]
    assert head == ["verdict: inconclusive", "[warning] inconclusive: kv_recall acc: could not have seen a drop of "
                    "0.02; about 391 documents would"]
