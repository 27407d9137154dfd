"""`--resume RUN_DIR` goes on with the run's own command and options: the cases it adds are the recorded run's
missing ones, with the recorded options; an option given again that differs is one line on stderr and exit 2,
before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "CI": "true", "HF_HUB_OFFLINE": "1"}


def kvdiag(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=600)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A memleak run of two dtypes and two cycles (its default: every dtype, three cycles) whose second case the
    run never recorded, as a run killed after its first case leaves it."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    r = kvdiag("memleak", "-d", "auto", "-d", "fp8", "--cycles", "2", "-o", run_dir, "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    first = records(run_dir)[0]
    (run_dir / "results.jsonl").write_text(json.dumps(first) + "\n")
    return run_dir, first


def test_resume_runs_the_missing_case_with_the_runs_own_options(interrupted):
    run_dir, first = interrupted
    r = kvdiag("memleak", "--resume", run_dir, "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    recs = records(run_dir)
    assert [x["kv_dtype"] for x in recs] == ["auto", "fp8"]  # not the default sweep's seven dtypes
    assert recs[0] == first  # recorded before: not run again
    assert recs[1]["params"]["cycles"] == 2 and len({s["cycle"] for s in recs[1]["metrics"]["snapshots"]}) == 3
    run = json.loads((run_dir / "run.json").read_text())
    assert run["command"].endswith("--cycles 2 -o " + str(run_dir) + " -q")  # the command that made the run
    assert run["call"]["kv_dtypes"] == ["auto", "fp8"] and run["call"]["options"]["cycles"] == 2
    assert [i for i, _ in run["plan"]] == [x["id"] for x in recs]


@pytest.mark.parametrize("again,said", [(("--cycles", "3"), "--cycles 3 differs from the run's 2"),
                                        (("-d", "auto"), "--kv-dtype auto differs from the run's auto,fp8"),
                                        (("-o", "elsewhere"), "a resumed run stays in its directory")])
def test_an_option_given_again_must_be_the_runs_own(interrupted, again, said):
    run_dir, _ = interrupted
    before = (run_dir / "results.jsonl").read_text()
    r = kvdiag("memleak", "--resume", run_dir, *again)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (run_dir / "results.jsonl").read_text() == before  # no worker started


def test_the_same_options_given_again_are_taken(interrupted):
    run_dir, _ = interrupted
    r = kvdiag("memleak", "--resume", run_dir, "-d", "fp8", "-d", "auto", "--cycles", "2", "-q")
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_library_call_resumes_the_same_way(interrupted):
    import kvdiag as api

    run_dir, _ = interrupted
    with pytest.raises(api.UserError, match="cycles=3|--cycles 3 differs"):
        api.run_check("memleak", resume=run_dir, cycles=3)
    with pytest.raises(api.UserError, match="is a run of 'memleak', not of 'poison'"):
        api.run_check("poison", resume=run_dir)


def test_a_run_of_other_cases_is_not_resumed(interrupted, tmp_path):
    """The plan: a run directory whose cases this command would not build (here its plan edited, as a changed
    kvdiag.toml does to `kvdiag ci --resume`) is refused."""
    from kvdiag.errors import UserError
    from kvdiag.run.resume import same_plan

    run_dir, _ = interrupted
    run = json.loads((run_dir / "run.json").read_text())
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "run.json").write_text(json.dumps({**run, "plan": run["plan"][:1]}))
    with pytest.raises(UserError, match=r"adds case memleak/builtin/tiny-llama/fp8 \(1 added, 0 missing"):
        from kvdiag.case import Case

        same_plan(copy, [Case("memleak", "builtin", "m", d, "t", id=i) for d, (i, _) in zip("ab", run["plan"])])
