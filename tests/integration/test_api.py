"""``kvdiag.run_check``: the library call every check command wraps. From Python it gives the run the command gives
(same cases, same verdict, same metrics), says in run.json what was called, writes the reports, and refuses bad input
with a UserError before any worker starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvdiag
from kvdiag.errors import UserError


def test_run_check_gives_the_run_the_command_gives(tmp_path):
    run = kvdiag.run_check("poison", kv_dtypes=["auto"], device="cpu", value="inf", output_dir=tmp_path / "lib",
                           quiet=True)
    assert run.exit_code == 0 and [c.status for c in run.cases] == ["pass"], run.cases
    (case,) = run.cases
    assert case.check == "poison" and case.kv_dtype == "auto" and case.params["value"] == "inf"
    recorded = json.loads((tmp_path / "lib" / "run.json").read_text())
    assert recorded["command"].startswith("kvdiag.run_check('poison', kv_dtypes=['auto']"), recorded["command"]
    assert "value='inf'" in recorded["command"]
    assert (tmp_path / "lib" / "report.html").is_file() and (tmp_path / "lib" / "report.md").is_file()

    # the command line, a separate process: the same case, the same verdict and measurements
    cli = subprocess.run([sys.executable, "-m", "kvdiag", "poison", "-d", "auto", "--device", "cpu", "--value", "inf",
                          "-o", str(tmp_path / "cli"), "--format", "json", "--quiet"],
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr
    (other,) = json.loads(cli.stdout)["cases"]
    assert other["id"] == case.id and other["status"] == case.status
    assert json.loads((tmp_path / "cli" / "run.json").read_text())["command"].startswith("kvdiag poison -d auto")
    for key in ("fresh_blocks", "poisoned_blocks", "identical", "requests"):
        assert other["metrics"][key] == case.metrics[key], key


@pytest.mark.parametrize("call, words", [
    (lambda out: kvdiag.run_check("leak", output_dir=out), "unknown check 'leak'; valid: accuracy, dtypes, memleak"),
    (lambda out: kvdiag.run_check("memleak", cylces=2, output_dir=out), "(did you mean 'cycles'?)"),
    (lambda out: kvdiag.run_check("memleak", cycles=0, output_dir=out),
     "cycles=0 (--cycles 0): expected an integer >= 1"),
    (lambda out: kvdiag.run_check("wake-cycle", levels=[3], output_dir=out),
     "levels=[3] (--level 3): expected a list of one of"),
    (lambda out: kvdiag.run_check("poison", kv_dtypes=["fp9"], output_dir=out), "fp9"),
    (lambda out: kvdiag.run_check("poison", engine_args={"no_such_key": 1}, output_dir=out), "no_such_key"),
])
def test_bad_input_is_a_user_error_before_any_worker_starts(tmp_path, call, words):
    out = tmp_path / "run"
    with pytest.raises(UserError) as e:
        call(out)
    assert words in str(e.value), str(e.value)
    assert not out.exists()  # no run directory: nothing started
