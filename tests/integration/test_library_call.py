"""`kvdiag.run_check` where users call it: a saved script, `python -` and a notebook cell, none of them under
`if __name__ == "__main__":`. The workers must not run the caller's top level again (multiprocessing re-imports
`__main__` unless told not to), and every case passes as it does from the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import kvdiag
print("TOP LEVEL RAN")
run = kvdiag.run_check("memleak", kv_dtypes=["auto", "fp8"], cycles=1, output_dir={out!r}, quiet=True)
print("RESULT", run.exit_code, *[c.status for c in run.cases])
"""
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "CI": "true"}


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_run_check_runs_from_a_script_without_a_main_guard(how, tmp_path):
    code = SCRIPT.format(out=str(tmp_path / "run"))
    if how == "script":
        (tmp_path / "call.py").write_text(code)
        r = subprocess.run([sys.executable, "call.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                           timeout=600)
    else:
        r = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("TOP LEVEL RAN") == 1, r.stdout  # not again in a worker
    assert r.stdout.splitlines()[-1] == "RESULT 0 pass pass", r.stdout + r.stderr[-3000:]
