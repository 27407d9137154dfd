"""Ctrl-C (SIGINT to kvdiag's process group, as a terminal sends it) and kill -9 of kvdiag during an accuracy sweep:
exit 130 with one line, no traceback, and no "leaked semaphore objects" warning from multiprocessing's resource
tracker once every process of the run has ended (lm_eval's progress bars in the workers made one per worker)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def interrupted(tmp_path, sig: int, whole_group: bool) -> tuple[int, str]:
    """(exit code, stderr once every process of the run has ended) of ``kvdiag accuracy --limit 2`` sent ``sig``
    while a worker is inside lm_eval (its log shows a progress bar)."""
    run_dir, err = tmp_path / "run", tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        # a terminal's Ctrl-C: SIGINT handled as by default, even where this test's own process inherited it ignored
        # (a job started with `&` from a shell without job control: Python then raises no KeyboardInterrupt)
        proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "accuracy", "--limit", "2", "-o", str(run_dir)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not any("it/s" in p.read_text(errors="replace") for p in run_dir.glob("logs/*.log")):
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "no case reached lm_eval in 300 s"
            time.sleep(0.02)
        assert re.search(r"\[1/7\] accuracy/builtin/tiny-llama/\S+ \.\.\.", err.read_text())  # a case had started
        # (whichever of the cases that start at once prints first)
        os.killpg(proc.pid, sig) if whole_group else os.kill(proc.pid, sig)
        code = proc.wait(timeout=120)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:  # the resource tracker speaks when the last process of the run ends
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("processes of the run still alive 60 s after kvdiag ended")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return code, err.read_text()


def test_ctrl_c_exits_130_without_traceback_or_leaked_semaphores(tmp_path):
    code, err = interrupted(tmp_path, signal.SIGINT, whole_group=True)
    assert code == 130, err
    assert err.rstrip().endswith("kvdiag: interrupted"), err
    assert "Traceback" not in err and "leaked semaphore" not in err, err


def test_kill_9_of_kvdiag_leaves_no_leaked_semaphore_warning(tmp_path):
    code, err = interrupted(tmp_path, signal.SIGKILL, whole_group=False)  # kvdiag only: its workers end themselves
    assert code == -signal.SIGKILL
    assert "leaked semaphore" not in err and "Traceback" not in err, err
