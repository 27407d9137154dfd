"""The package as installed is the package as tested: the wheel carries every module of the checkout, each imports
from the installed copy (not the source tree), and the main job and the vLLM self-test's catalogue run from it."""

from __future__ import annotations

import json
import re
import time
import zipfile

import pytest
from installed import ROOT

WALK = """
import importlib, json, pkgutil, sys
import kvdiag
bad, files = {}, {}
for m in pkgutil.walk_packages(kvdiag.__path__, "kvdiag."):
    if m.name.endswith("__main__"):  # runs the CLI
        continue
    try:
        files[m.name] = importlib.import_module(m.name).__file__
    except Exception as e:
        bad[m.name] = f"{type(e).__name__}: {e}"
print(json.dumps({"files": files, "bad": bad, "root": kvdiag.__file__}))
"""


def source_modules() -> set[str]:
    """Every importable module of the checkout's kvdiag/ and of kernels/ (kvdiag.kernels), the data folders left
    out."""
    from test_import_graph import SOURCES, find_modules

    return {m for m, (path, _) in find_modules(SOURCES).items()
            if not {"assets", "data"} & set(path.relative_to(ROOT).parts)}


@pytest.mark.slow
def test_the_wheel_carries_every_module_of_the_checkout(installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    shipped = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in names if n.endswith(".py")}
    missing = source_modules() - shipped
    assert not missing, f"the wheel leaves out {sorted(missing)}"
    assert any(n.startswith("kvdiag/assets/tiny-llama/") for n in names)  # the shipped model and tasks are data
    assert any(n.startswith("kvdiag/tasks/") and n.endswith(".yaml") for n in names)


@pytest.mark.slow
def test_every_module_imports_from_the_installed_copy(installed):
    import subprocess

    p = subprocess.run([installed.python, "-c", WALK], capture_output=True, text=True, cwd=installed.cwd,
                       env=installed.env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    walk = json.loads(p.stdout.strip().splitlines()[-1])
    assert not walk["bad"], walk["bad"]
    assert set(walk["files"]) >= source_modules() - {"kvdiag", "kvdiag.__main__"}
    outside = {m: f for m, f in walk["files"].items() if not f.startswith(str(installed.prefix))}
    assert not outside and walk["root"].startswith(str(installed.prefix)), outside


@pytest.mark.slow
def test_the_main_job_runs_from_the_wheel_as_the_readme_shows_it(installed):
    """The README's main job, `kvdiag accuracy` with no option (builtin engine, the shipped model and tasks, every
    dtype, every document), from the installed console script in a folder of its own, as a user runs it after
    `pip install`. It says what the README's sample output shows: each row's score, change, the drop it sees and
    verdict; each drift row; `OK: 7 pass — results in reports/<timestamp>-accuracy` (exit 0), in at most 3x the time
    the README states; and what the text says of the dtypes: the shipped tasks' 200 and 100 documents, bfloat16 and
    float16 bit for bit `auto` and `ok`, every quantized dtype `inconclusive` (a pass) with the documents that would
    settle it, each storing its own codes and drifting. The docs' inventory (test_docs_examples.py) names this test.
    The same run, in an 80-column terminal, holds what other tests ran their own small sweeps for: the table fits
    with every name whole and names its reports; each case's worker takes the tasks its fork server loaded; lm_eval's
    hint to pass --metadata is not printed for kvdiag's own tasks, nor logged."""
    from doc_examples import idle_seconds, readme_main_job

    doc = readme_main_job()
    t = time.perf_counter()
    p = installed.run("accuracy", COLUMNS="80")
    took = time.perf_counter() - t
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    last = re.escape(doc["last"]).replace(re.escape("<timestamp>"), r"(\d{8}-\d{6})")
    m = re.fullmatch(last, lines[-1])
    assert m, (lines[-1], doc["last"])
    assert " ".join(p.stdout.split()).startswith(" ".join(doc["header"].split())), lines[:2]  # the table's title
    run = json.loads((installed.cwd / "reports" / f"{m.group(1)}-accuracy" / "run.json").read_text())
    assert idle_seconds(run, took) <= 3 * doc["seconds"], (took, run["analysis"]["accuracy"]["timings"])
    cases = {c["kv_dtype"]: c for c in run["cases"]}
    assert list(cases) == ["auto", "bfloat16", "float16", "fp8", "fp8_e5m2", "int8_per_token_head",
                           "fp8_per_token_head"] and {c["status"] for c in cases.values()} == {"pass"}
    rows = {(r["kv_dtype"], r["task"], r["metric"]): r for r in run["analysis"]["accuracy"]["rows"]}
    for want in doc["scores"]:  # the sample's rows, within a document or two
        got = rows[(want.kv_dtype, want.task, want.metric)]
        assert (got["verdict"], got.get("n_needed") if got["verdict"] == "inconclusive" else None) == (
            want.verdict, want.n_needed), (want, got)
        assert abs(got["score"] - want.score) <= 0.01 and abs(got["delta"] - want.delta) <= 0.01, (want, got)
        assert got["mdd"] == pytest.approx(want.mdd, abs=1e-4) and got["p_value"] == pytest.approx(want.p_value), got
    for want in doc["drift"]:  # KL within a fifth, top-1 within a point
        got = rows[(want.kv_dtype, "kv_recall", "acc")]
        assert got["mean_kl"] == pytest.approx(want.mean_kl, rel=0.2), (want, got)
        assert got["max_kl"] == pytest.approx(want.max_kl, rel=0.2) and abs(got["top1_agreement"] - want.top1) <= 0.01

    scores = cases["auto"]["metrics"]["scores"]
    assert {task: metrics["acc"]["n"] for task, metrics in scores.items()} == {"kv_recall": 200, "kv_recall_long": 100}
    by_dtype: dict = {}
    for r in run["analysis"]["accuracy"]["rows"]:
        by_dtype.setdefault(r["kv_dtype"], []).append(r)
    assert {(r["task"], r["metric"], r["score"], r["verdict"]) for r in by_dtype["auto"]} == {
        (t, m, 1.0, "baseline") for t in ("kv_recall", "kv_recall_long") for m in ("acc", "acc_norm")}
    for dtype in ("bfloat16", "float16"):  # the shipped model is bf16: bit for bit auto, no drop to miss
        for r in by_dtype[dtype]:
            assert (r["delta"], r["discordant"], r["mean_kl"], r["max_kl"], r["verdict"]) == (0.0, [0, 0], 0.0, 0.0,
                                                                                            "ok"), r
    for dtype in ("fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"):
        # 200 and 100 documents cannot see a 2-point drop: a pass that says so, with the documents that would
        assert all(r["verdict"] == "inconclusive" and r["mdd"] > 0.02 and r["n_needed"] > 100 for r in by_dtype[dtype])
        assert by_dtype[dtype][0]["mean_kl"] > 0, dtype  # quantized: some drift, within its family's limits
    # each quantized dtype stores its own codes: none is taken for one that changes nothing
    assert not [(d, f["kind"]) for d, c in cases.items() for f in c["findings"]
                if f["kind"] in ("not_quantized", "identical_to_baseline")]
    assert cases["int8_per_token_head"]["metrics"]["storage"]["layer_dtypes"][0] == "int8"  # the storage audit ran
    run_dir = installed.cwd / "reports" / f"{m.group(1)}-accuracy"
    assert "score 95% CI" in (run_dir / "report.md").read_text() and "score 95% CI" in (run_dir / "report.html"
                                                                                         ).read_text()

    assert all(len(line) <= 80 for line in lines) and "…" not in p.stdout, p.stdout  # 80 columns, names whole
    assert set(cases) | {"kv_recall", "kv_recall_long"} <= set(re.findall(r"[\w.-]+", p.stdout))
    assert "report.md, report.html" in p.stdout  # the promise, kept
    assert all(c["metrics"]["lm_eval"]["tasks_preloaded"] for c in cases.values())  # by the fork server
    logs = "".join(f.read_text() for f in (run_dir / "logs").iterdir())
    assert "accuracy/builtin" in p.stderr and logs and "--metadata" not in p.stderr + logs


@pytest.mark.slow
@pytest.mark.vllm
def test_the_vllm_fault_catalogue_lists_from_the_wheel(installed):
    from kvdiag.engines.vllm.selftest import CATALOGUE

    pytest.importorskip("vllm")
    p = installed.run("selftest", "-e", "vllm", "--list", COLUMNS="400")
    assert p.returncode == 0, p.stderr[-3000:]
    for name in CATALOGUE.names:
        assert name in p.stdout, (name, p.stdout)
