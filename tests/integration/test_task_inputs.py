"""Tasks are resolved and loaded once in kvdiag's own process before any worker starts (issue 29 item 3): an
unknown task and a task whose dataset cannot be had offline exit 2 in seconds with one line. That the workers get the
tasks from their fork server, which loaded them once (issue 26), the README's main job says of each of its cases
(tests/integration/test_wheel.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_seconds import timed_run

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CI": "true"}


def kvdiag(*args, cwd=None, timeout=600):
    """The run and the CPU seconds it took: "in seconds" is the work done, which a busy machine does not stretch as
    it stretches the wall clock."""
    return timed_run([sys.executable, "-m", "kvdiag", *args], env=OFFLINE, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def warm_index():
    """lm_eval's own task index, built once per installed lm_eval and kept on disk (kvdiag.tasks.default_index)."""
    code = "from kvdiag.tasks import default_index; print(len(default_index()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=OFFLINE, timeout=600)
    assert r.returncode == 0 and int(r.stdout.split()[-1]) > 1000, r.stderr[-2000:]


def test_the_cached_index_knows_what_lm_evals_own_index_knows(warm_index):
    from lm_eval.tasks import TaskManager

    from kvdiag.tasks import task_manager

    cached, plain = task_manager((), True), TaskManager(include_defaults=True)
    assert set(plain.all_tasks) <= set(cached.all_tasks) and "kv_recall" in cached.all_tasks
    assert set(plain.all_groups) <= set(cached.all_groups) and set(plain.all_tags) <= set(cached.all_tags)
    assert "arc_easy" in cached.all_subtasks and "mmlu" in cached.all_groups


def test_an_unknown_task_exits_2_in_seconds_with_one_line(warm_index, tmp_path):
    r, seconds = kvdiag("accuracy", "-d", "bf16", "-t", "no_such_task_xyz", "-o", str(tmp_path / "run"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown task 'no_such_task_xyz'" in r.stderr and seconds < 5, seconds
    assert not (tmp_path / "run" / "logs").exists()


def test_a_dataset_that_cannot_be_had_offline_exits_2_in_seconds_with_one_line(warm_index, tmp_path):
    (tmp_path / "hub_task.yaml").write_text(
        "task: hub_only_task\ndataset_path: kvdiag-tests/not-in-any-cache\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: 0\ndoc_to_choice: ['a', 'b']\n"
        "metric_list:\n  - metric: acc\n")
    r, seconds = kvdiag("accuracy", "-d", "bf16", "-t", "hub_only_task", "--include-path", str(tmp_path),
                        "--limit", "5", "-o", str(tmp_path / "run"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "hub_only_task: cannot load their data" in r.stderr and "offline" in r.stderr
    assert seconds < 5, seconds
    assert not (tmp_path / "run" / "logs").exists()  # no worker started
