"""The package as installed is the package as tested: the wheel carries every module of the checkout, each imports
from the installed copy (not the source tree), and the main job and the vLLM self-test's catalogue run from it."""

from __future__ import annotations

import json
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
def test_the_main_job_runs_from_the_wheel(installed):
    """`kvdiag accuracy` (builtin engine, shipped model and tasks, every dtype) from the installed console script,
    a few documents a task."""
    out = installed.cwd / "main-job"
    p = installed.run("accuracy", "--limit", "4", "--format", "json", "--quiet", "-o", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(p.stdout)
    assert run["cases"] and all(c["status"] == "pass" for c in run["cases"]), \
        [(c["kv_dtype"], c["status"]) for c in run["cases"]]
    assert (out / "report.html").exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_the_vllm_fault_catalogue_lists_from_the_wheel(installed):
    from kvdiag.engines.vllm.selftest import CATALOGUE

    pytest.importorskip("vllm")
    p = installed.run("selftest", "-e", "vllm", "--list", COLUMNS="400")
    assert p.returncode == 0, p.stderr[-3000:]
    for name in CATALOGUE.names:
        assert name in p.stdout, (name, p.stdout)
