"""kill -9 of kvdiag mid-run loses no finished case, leaves no worker behind, and --resume completes the run;
a truncated line in results.jsonl is reported once and skipped, and its case runs again on --resume."""

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

CONFIG = """
kv_dtypes = ["auto", "fp8", "bfloat16"]
[memleak]
cycles = 1
max_tokens = 2
"""
IDS = {f"memleak/builtin/tiny-llama/{d}" for d in ("auto", "fp8", "bfloat16")}
pytestmark = pytest.mark.slow


def kvdiag(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          timeout=900)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    cfg, run_dir = root / "kvdiag.toml", root / "run"
    cfg.write_text(CONFIG)
    proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "ci", "-c", str(cfg), "-o", str(run_dir), "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    results = run_dir / "results.jsonl"
    try:
        deadline = time.monotonic() + 600
        while not (results.exists() and results.read_text().count("\n") >= 1):
            assert proc.poll() is None, "kvdiag ended before it was killed"
            assert time.monotonic() < deadline, "no case finished in 600 s"
            time.sleep(0.2)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        before = records(results)
        os.kill(proc.pid, signal.SIGKILL)  # kvdiag itself only: its workers must notice and exit
        proc.wait()
        t0 = time.monotonic()
        while not all(gone(pid) for pid in children) and time.monotonic() - t0 < 15:
            time.sleep(0.2)
        orphans = [pid for pid in children if not gone(pid)]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # clean up whatever this test started, should a check fail
        except (ProcessLookupError, PermissionError):
            pass
    resumed = kvdiag("ci", "-c", cfg, "--resume", run_dir, "-q")
    return {"cfg": cfg, "run_dir": run_dir, "children": children, "orphans": orphans, "before": before,
            "resumed": resumed}


def test_kill_9_loses_nothing_and_resume_completes(killed):
    assert killed["children"], "kvdiag had no worker running when it was killed"
    assert killed["orphans"] == [], "workers outlived kvdiag"
    before = killed["before"]
    assert 1 <= len(before) < 3 and {r["id"] for r in before} < IDS
    r = killed["resumed"]
    assert r.returncode == 0, r.stderr[-3000:]
    after = records(killed["run_dir"] / "results.jsonl")
    counts = collections.Counter(rec["id"] for rec in after)
    assert set(counts) == IDS and set(counts.values()) == {1}  # every case exactly once
    assert after[:len(before)] == before  # finished cases kept, not run again
    run = json.loads((killed["run_dir"] / "run.json").read_text())
    assert run["exit_code"] == 0 and {c["id"] for c in run["cases"]} == IDS
    assert (killed["run_dir"] / "junit.xml").exists()


def test_truncated_line_is_reported_once_skipped_and_rerun(killed, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(killed["run_dir"], run_dir)
    path = run_dir / "results.jsonl"
    lines = path.read_text().splitlines()
    lost = json.loads(lines[-1])["id"]
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    r = kvdiag("report", run_dir, "--format", "json")
    assert r.returncode == 0
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvdiag: warning: ") and \
        f"results.jsonl:{len(lines)}: skipped a corrupt record" in r.stderr, r.stderr
    assert {c["id"] for c in json.loads(r.stdout)["cases"]} == IDS - {lost}
    r = kvdiag("ci", "-c", killed["cfg"], "--resume", run_dir, "-q")
    assert r.returncode == 0 and r.stderr.count("kvdiag: warning:") == 1, r.stderr[-3000:]
    good = []
    for line in path.read_text().splitlines():
        try:
            good.append(json.loads(line)["id"])
        except ValueError:
            continue
    assert sorted(good) == sorted(IDS)  # the re-run record is on a line of its own, not glued to the torn one
