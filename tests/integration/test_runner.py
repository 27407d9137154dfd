"""The case runner: isolation of crashes, timeouts and errors; order; resume."""

import json
import os
import re
import subprocess
import sys

import pytest

from kvdiag.results import read_jsonl
from kvdiag.run.runner import Case, run_cases


def case(fn, n, **params):
    return Case(check="t", engine="none", model="m", kv_dtype=f"d{n}", target=f"case_fns:{fn}",
                params={"value": n, **params}, id=f"t/{n}-{fn}")


@pytest.fixture
def mixed():
    return [case("healthy", 0), case("abort", 1), case("healthy", 2), case("segfault", 3),
            case("healthy", 4), case("hang", 5), case("raises", 6), case("exits", 7), case("healthy", 8),
            case("failing", 9)]


@pytest.mark.slow
def test_crashes_timeouts_and_errors_become_records(tmp_path, mixed):
    recs = run_cases(mixed, tmp_path, timeout=5, quiet=True)
    assert [r.id for r in recs] == [c.id for c in mixed]  # order and count
    by = {r.id: r for r in recs}
    status = {r.id.split("-")[1] + r.id.split("/")[1].split("-")[0]: r.status for r in recs}
    assert status == {"healthy0": "pass", "abort1": "crashed", "healthy2": "pass", "segfault3": "crashed",
                      "healthy4": "pass", "hang5": "timeout", "raises6": "error", "exits7": "crashed",
                      "healthy8": "pass", "failing9": "fail"}
    assert by["t/1-abort"].findings[0].evidence["signal"] == "SIGABRT"
    assert "about to abort" in by["t/1-abort"].log_tail
    assert by["t/3-segfault"].findings[0].evidence["signal"] == "SIGSEGV"
    assert "Fatal Python error" in by["t/3-segfault"].log_tail  # faulthandler's stack in the tail
    assert by["t/7-exits"].findings[0].evidence["exit_code"] == 7
    assert "planted error" in by["t/6-raises"].findings[0].message
    assert "RuntimeError" in by["t/6-raises"].log_tail
    hung = by["t/5-hang"].findings[0]
    assert hung.kind == "timeout"
    # before the kill, the worker dumped its stacks: the record says where the case waited
    assert re.fullmatch(r"\S*case_fns\.py:\d+ \(hang\)", hung.evidence["hung_at"][0]), hung.evidence
    assert "; hung at " in hung.message and "most recent call first" in by["t/5-hang"].log_tail
    # each healthy case ran in its own process
    pids = {by[f"t/{n}-healthy"].metrics["pid"] for n in (0, 2, 4, 8)}
    assert len(pids) == 4
    # every record is in results.jsonl, in order
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == [c.id for c in mixed]


def test_resume_reruns_only_missing(tmp_path):
    first = [case("healthy", 0), case("healthy", 1)]
    run_cases(first, tmp_path, quiet=True)
    before = read_jsonl(tmp_path / "results.jsonl")
    allc = first + [case("healthy", 2), case("failing", 3)]
    recs = run_cases(allc, tmp_path, resume=True, quiet=True)
    assert [r.id for r in recs] == [c.id for c in allc]
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == [c.id for c in allc]  # the first two were not run again
    assert recs[0].metrics["pid"] == before["t/0-healthy"].metrics["pid"]


def test_shared_worker_crash_ends_the_rest_of_its_group(tmp_path):
    cases = [case("healthy", 0), case("segfault", 1), case("healthy", 2), case("healthy", 3)]
    for c in cases[:3]:
        c.group = "g"
    recs = run_cases(cases, tmp_path, quiet=True, timeout=30)
    assert [r.status for r in recs] == ["pass", "crashed", "error", "pass"]
    assert recs[2].findings[0].kind == "not_run"
    assert recs[0].metrics["pid"] != recs[3].metrics["pid"]


def test_running_out_of_device_memory_is_a_resource_error_not_an_exception(tmp_path):
    recs = run_cases([case("no_cache_memory", 0), case("raises", 1)], tmp_path, quiet=True, timeout=30)
    assert [r.status for r in recs] == ["error", "error"]
    assert [f.kind for f in recs[0].findings] == ["resource"]
    assert recs[0].findings[0].message.startswith("ValueError: No available memory for the cache blocks")
    assert [f.kind for f in recs[1].findings] == ["exception"]  # any other exception stays one


def test_resource_failure_reads_the_exception_chain():
    from kvdiag.errors import resource_failure

    def chained():
        try:
            raise AssertionError("Error in memory profiling. Initial free memory 70.1 GiB, current free memory "
                                 "60.3 GiB. This happens when other processes sharing the same container release GPU "
                                 "memory while vLLM is profiling during initialization.")
        except AssertionError as e:
            raise RuntimeError("Engine core initialization failed. See root cause above.") from e

    with pytest.raises(RuntimeError) as info:
        chained()
    assert resource_failure(info.value).startswith("AssertionError: Error in memory profiling")
    assert resource_failure(RuntimeError("CUDA error: out of memory")) == "RuntimeError: CUDA error: out of memory"
    assert resource_failure(ValueError("fp8_e5m2 KV cache needs compute capability >= 8.9")) is None


def test_corrupt_line_is_reported_and_skipped(tmp_path, capsys):
    run_cases([case("healthy", 0), case("healthy", 1)], tmp_path, quiet=True)
    path = tmp_path / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2] + "\n")
    warnings = []
    recs = read_jsonl(path, warn=warnings.append)
    assert list(recs) == ["t/0-healthy"]
    assert "results.jsonl:2" in warnings[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_the_fork_server_starts_with_the_workers_env(tmp_path):
    # OpenMP reads OMP_WAIT_POLICY once, when the fork server's preloaded torch loads it: the server itself
    # must start with the workers' env, and kvdiag's own environment must be left as it was. (In a fresh
    # process: a fork server lives as long as the process that started it.)
    SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    script = f"""if True:
        import os, sys
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {SUPPORT!r}]
        from test_runner import case
        from kvdiag.run.runner import run_cases
        recs = run_cases([case("server_env", 0)], {str(tmp_path)!r}, quiet=True, timeout=30, preload=("case_fns",),
                         env={{"OMP_WAIT_POLICY": "PASSIVE"}})
        print(recs[0].status, recs[0].metrics.get("server_wait_policy"), os.environ.get("OMP_WAIT_POLICY"))"""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["pass", "PASSIVE", "None"], out.stderr[-2000:]


@pytest.mark.slow
def test_the_last_workers_of_a_sweep_get_the_cores_the_finished_ones_freed(tmp_path):
    # 3 cases, 2 at once, 2 cores shared: the first two get 1 thread each, the third (alone once the others end)
    # both cores; torch in a fork-server worker follows the env
    cases = [case("threads", n) for n in range(3)]
    recs = run_cases(cases, tmp_path, quiet=True, timeout=60, jobs=2, preload=("torch",),
                     env={"OMP_NUM_THREADS": "1", "KVDIAG_SHARE_CORES": "2"})
    assert [(r.metrics["omp"], r.metrics["torch"]) for r in recs] == [("1", 1), ("1", 1), ("2", 2)]
    recs = run_cases(cases, tmp_path / "b", quiet=True, timeout=60, jobs=2, env={"OMP_NUM_THREADS": "1"})
    assert [r.metrics["omp"] for r in recs] == ["1", "1", "1"]  # without sharing: as given


def test_fork_server_workers_are_isolated_and_not_taken_for_orphans(tmp_path):
    # preload: workers fork from a fork server (their parent is not kvdiag); a case longer than the
    # parent watchdog's 1 s period must still finish, and a crash stays that case's record
    slow = case("touch_then_sleep", 2, sleep=2.5)
    slow.params["n"] = 2
    cases = [case("healthy", 0), case("segfault", 1), slow, case("healthy", 3)]
    recs = run_cases(cases, tmp_path, quiet=True, timeout=30, preload=("case_fns",), env={"OMP_NUM_THREADS": "1"})
    assert [r.status for r in recs] == ["pass", "crashed", "pass", "pass"]
    assert recs[1].findings[0].evidence["signal"] == "SIGSEGV"
    assert recs[0].metrics["pid"] != recs[3].metrics["pid"]


def test_a_worker_runs_cases_of_its_group_at_once_on_threads(tmp_path):
    # --isolate run with jobs for the builtin engine on the CPU: one process, 2 cases at a time, each thread with
    # its share of the cores (the third alone: both)
    cases = [case("timed", n, sleep=1.0) for n in range(3)]
    for c in cases:
        c.group = "g"
    recs = run_cases(cases, tmp_path, quiet=True, timeout=60, threads=2, preload=("torch",),
                     env={"OMP_NUM_THREADS": "2", "KVDIAG_SHARE_CORES": "2"})
    assert [r.status for r in recs] == ["pass"] * 3 and [r.id for r in recs] == [c.id for c in cases]
    m = [r.metrics for r in recs]
    assert len({x["pid"] for x in m}) == 1 and len({x["thread"] for x in m}) == 2
    assert m[1]["start"] < m[0]["end"] and m[0]["start"] < m[1]["end"]  # the first two overlapped
    assert m[2]["start"] >= min(m[0]["end"], m[1]["end"]) - 0.05  # the third waited for a free thread
    assert [x["torch"] for x in m] == [1, 1, 2]


def test_a_crash_on_one_thread_ends_the_cases_running_beside_it_and_the_rest(tmp_path):
    cases = [case("timed", 0, sleep=3.0), case("abort", 1), case("healthy", 2), case("healthy", 3)]
    for c in cases[:3]:
        c.group = "g"
    recs = run_cases(cases, tmp_path, quiet=True, timeout=30, threads=2)
    assert [r.status for r in recs] == ["crashed", "crashed", "error", "pass"]
    assert recs[1].findings[0].evidence["signal"] == "SIGABRT" and "about to abort" in recs[1].log_tail
    assert "also running t/0-timed" in recs[1].findings[0].message  # which thread crashed is not known
    assert recs[2].findings[0].kind == "not_run"


@pytest.mark.slow
def test_a_hung_thread_times_out_alone_and_the_cases_before_it_keep_their_results(tmp_path):
    # each case's timeout counts from its own start, not from the last result of the worker
    cases = [case("hang", 0), case("timed", 1, sleep=1.5), case("timed", 2, sleep=1.5), case("timed", 3, sleep=60)]
    for c in cases:
        c.group = "g"
    recs = run_cases(cases, tmp_path, quiet=True, timeout=6, threads=2, preload=("torch",))
    assert [r.status for r in recs] == ["timeout", "pass", "pass", "error"]
    assert recs[0].findings[0].kind == "timeout" and "about to hang" in recs[0].log_tail
    assert 5.5 < recs[0].duration_s < 9
    assert recs[3].findings[0].message.startswith("was cut short")  # running beside it when the worker was killed


def test_a_hung_case_whose_stack_dump_begins_late_still_says_where_it_hung(tmp_path):
    """The runner waits for the dump to begin before it kills the worker (two vLLM hangs on the GPU lost theirs)."""
    (rec,) = run_cases([Case("t", "e", "m", "d", "case_fns:hang_dumping_late", id="t/late")], tmp_path, quiet=True,
                       timeout=4)
    f = rec.findings[0]
    assert rec.status == "timeout" and "tests/support/case_fns.py:" in f.evidence.get("hung_at", [""])[0], f.message
    assert "; hung at " in f.message


def test_a_worker_that_dies_after_a_cuda_error_names_the_error_line_and_the_stage(tmp_path):
    """SIGABRT after a CUDA error: the finding says which stage the case was in and CUDA's own line, not only the
    signal (issue 26)."""
    (rec,) = run_cases([Case("t", "e", "m", "d", "case_fns:cuda_abort", id="t/cuda")], tmp_path, quiet=True)
    f = rec.findings[0]
    assert rec.status == "crashed" and f.evidence["signal"] == "SIGABRT"
    assert f.evidence["stage"] == "lm_eval"
    assert f.evidence["cause"] == "CUDA error: an illegal memory access was encountered"
    assert f.message == "worker died with SIGABRT (aborted) in stage lm_eval: " + f.evidence["cause"]
