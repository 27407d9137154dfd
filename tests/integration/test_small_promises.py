"""What the docs and --help promise in small things: an incomplete merge of shards fails and says what it lacks;
`compare` of runs of other tasks is bad input; --help names what a command takes; a bad device or engine argument
in a config is one line at its own line, before any worker starts; `ci --update-baseline` says what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "CI": "true", "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}


def kvdiag(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=600)


def one_line(r, code: int, *said: str) -> None:
    assert r.returncode == code and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert all(s in r.stderr for s in said), r.stderr


def write_run(run_dir: Path, cases: list, **fields) -> Path:
    from kvdiag.results import RunRecord, append_jsonl, write_run_json

    run_dir.mkdir(parents=True)
    for c in cases:
        append_jsonl(run_dir / "results.jsonl", c)
    write_run_json(run_dir, RunRecord(command="kvdiag ci", started="2026-11-29T00:00:00+00:00", cases=cases,
                                      environment={}, run_dir=str(run_dir), exit_code=0, **fields))
    return run_dir


def case(cid: str, **metrics):
    from kvdiag.results import CaseResult

    return CaseResult(id=cid, check="accuracy", engine="builtin", model="m", kv_dtype=cid.rsplit("/", 1)[-1],
                      status="pass", metrics=metrics)


def test_a_merge_that_lacks_a_shard_fails_and_says_which(tmp_path):
    one = write_run(tmp_path / "s1", [case("accuracy/builtin/m/auto")],
                    shard={"suite": "abc", "index": 1, "count": 2, "balanced_by": "round robin"})
    r = kvdiag("report", "--merge", one, "-o", tmp_path / "all")
    assert r.returncode == 1 and "shards 2 of 2 missing" in r.stderr, r.stderr
    assert "Incomplete: shards 2 of 2 missing" in (tmp_path / "all" / "report.md").read_text()
    assert "FAILED" in (tmp_path / "all" / "report.md").read_text().splitlines()[0]
    r = kvdiag("report", tmp_path / "all", "--format", "table")
    assert "FAILED: 1 pass (shards 2 of 2 missing)" in r.stdout, r.stdout


def test_compare_of_runs_of_other_tasks_is_bad_input(tmp_path):
    score = {"acc": {"score": 1.0, "stderr": 0.0, "n": 5, "higher_is_better": True}}
    old = write_run(tmp_path / "a", [case("accuracy/builtin/m/auto", scores={"kv_recall": score})])
    new = write_run(tmp_path / "b", [case("accuracy/builtin/m/auto", scores={"kv_recall_long": score})])
    one_line(kvdiag("compare", old, new), 2, "OLD: kv_recall; NEW: kv_recall_long", "nothing to compare")
    assert kvdiag("compare", old, old).returncode == 0  # the same tasks: compared, nothing regressed


def test_help_names_what_each_command_takes():
    text = kvdiag("compare", "--help").stdout
    assert "OLD" in text and "NEW" in text and " PATH " not in text, text
    from kvdiag.checks.registry import checks

    flat = " ".join(kvdiag("ci", "--help").stdout.split())
    assert all(f"[{name}]" in flat for name in checks()), flat  # paths among them
    bench = " ".join(kvdiag("bench", "--help").stdout.split())
    assert "--device DEVICE cuda or cuda:N" in bench and "cpu" not in bench.split("--device", 1)[1][:80], bench


def test_a_bad_device_or_engine_argument_is_one_line_at_its_own_line(tmp_path):
    (tmp_path / "a.toml").write_text('kv_dtypes = ["auto"]\n[memleak]\nengine_args = {foo = 1}\n')
    one_line(kvdiag("ci", "-c", tmp_path / "a.toml", "-o", tmp_path / "ra"), 2, "a.toml:3:", "'foo'")
    (tmp_path / "b.toml").write_text('[memleak]\ndevice = "tpu"\n')
    one_line(kvdiag("ci", "-c", tmp_path / "b.toml", "-o", tmp_path / "rb"), 2, "b.toml:2:", "'tpu'")
    one_line(kvdiag("memleak", "--device", "tpu", "-o", tmp_path / "rc"), 2, "expected auto, cpu, cuda or cuda:N")
    assert not any((tmp_path / d / "logs").exists() for d in ("ra", "rb", "rc"))  # no worker started


def test_update_baseline_says_what_it_wrote(tmp_path):
    (tmp_path / "suite.toml").write_text('kv_dtypes = ["auto"]\n[memleak]\ncycles = 1\nmax_tokens = 2\n')
    base = tmp_path / "baselines" / "b.json"
    r = kvdiag("ci", "-c", tmp_path / "suite.toml", "--update-baseline", "--baseline", base, "-o", tmp_path / "r")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"kvdiag: wrote baseline {base} (1 cases); commit it" in r.stderr and base.is_file()
    assert json.loads(base.read_text())["cases"]
