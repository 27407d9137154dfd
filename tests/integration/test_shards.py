"""A suite over several machines: `kvdiag ci --shard K/N` runs a deterministic share (every case in exactly one
shard, cases judged together in one), `--durations` balances it, `kvdiag report --merge` puts the runs back together;
runs of different suites are refused with exit 2."""

import itertools
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvdiag.errors import UserError
from kvdiag.run import shards
from kvdiag.run.runner import Case

CONFIG = """
kv_dtypes = ["auto", "fp8"]
timeout = 400

[memleak]
cycles = 1
max_tokens = 4

[accuracy]
tasks = ["kv_recall"]
limit = 5

[poison]
kv_dtypes = ["auto"]
"""


def kvdiag(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          env=os.environ, timeout=900)


def suite(n_sweeps=2, n_single=5):
    cases = [Case("memleak", "builtin", "m", f"d{i}", "x:y", id=f"memleak/{i}") for i in range(n_single)]
    scopes = []
    for s in range(n_sweeps):
        ids = {f"accuracy{s}/{d}" for d in ("auto", "fp8", "int8")}
        cases += [Case("accuracy", "builtin", "m", cid.split("/")[1], "x:y", id=cid) for cid in sorted(ids)]
        scopes.append(ids)
    cases += [Case("wake-cycle", "builtin", "m", "auto", "x:y", id=f"wake/{i}", group="shared") for i in range(2)]
    return cases, scopes


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_every_case_is_in_exactly_one_shard_and_judged_cases_stay_together(n):
    cases, scopes = suite()
    parts = [shards.select(cases, scopes, (k, n)) for k in range(1, n + 1)]
    ids = [c.id for p in parts for c in p]
    assert sorted(ids) == sorted(c.id for c in cases) and len(ids) == len(set(ids))
    for scope in [*scopes, {"wake/0", "wake/1"}]:
        assert sum(bool(scope & {c.id for c in p}) for p in parts) == 1, scope
    assert parts == [shards.select(list(cases), scopes, (k, n)) for k in range(1, n + 1)]  # stable


def test_durations_balance_the_shards_within_lpt_bound_of_the_best_split():
    cases, scopes = suite()
    times = {c.id: t for c, t in zip(cases, [30, 1, 2, 40, 3, 5, 5, 5, 20, 20, 20, 9, 9])}
    units = shards.units(cases, scopes)
    cost = [sum(times[c.id] for c in u) for u in units]
    for n in (2, 3):
        got = shards.assign(units, n, times)
        loads = [sum(c for c, s in zip(cost, got) if s == k) for k in range(n)]
        best = min(max(sum(c for c, s in zip(cost, split) if s == k) for k in range(n))
                   for split in itertools.product(range(n), repeat=len(units)))
        assert max(loads) <= best * (4 / 3 - 1 / (3 * n)) + 1e-9, (loads, best)  # Graham's bound for LPT
    assert shards.assign(units, 2) == [i % 2 for i in range(len(units))]  # no durations: round robin


@pytest.mark.parametrize("text", ["0/2", "3/2", "a/b", "2", "1/0", ""])
def test_bad_shard_is_one_line(text):
    with pytest.raises(UserError, match="--shard"):
        shards.parse_shard(text)


@pytest.fixture(scope="module")
def shard_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    (root / "kvdiag.toml").write_text(CONFIG)
    (root / "other.toml").write_text(CONFIG.replace('limit = 5', 'limit = 4').replace('["auto", "fp8"]', '["auto"]'))
    for k in (1, 2):
        r = kvdiag("ci", "--config", root / "kvdiag.toml", "--shard", f"{k}/2", "-o", root / f"s{k}", "-q")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = kvdiag("ci", "--config", root / "other.toml", "--shard", "1/2", "-o", root / "other", "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    return root


def full_suite_ids(config: Path) -> set:
    from kvdiag.ci.config import load_config
    from kvdiag.ci.suite import build_suite

    return {c.id for c in build_suite(load_config(config))[0]}


@pytest.mark.slow
def test_two_shards_run_every_case_once_and_merge_into_one_run(shard_runs, tmp_path):
    root = shard_runs
    ran = [{json.loads(x)["id"] for x in (root / f"s{k}" / "results.jsonl").read_text().splitlines()} for k in (1, 2)]
    assert ran[0] and ran[1] and not ran[0] & ran[1]
    assert ran[0] | ran[1] == full_suite_ids(root / "kvdiag.toml")
    accuracy = {i for i in ran[0] | ran[1] if i.startswith("accuracy/")}
    assert accuracy <= ran[0] or accuracy <= ran[1]  # the baseline and its dtypes in one shard
    r = kvdiag("report", "--merge", root / "s2", root / "s1", "-o", tmp_path / "all")  # in any order
    assert r.returncode == 0, r.stderr
    merged = json.loads((tmp_path / "all" / "run.json").read_text())
    assert [(s["index"], Path(s["run_dir"]).name) for s in merged["environment"]["shards"]] == [(1, "s1"), (2, "s2")]
    assert all(s["hostname"] for s in merged["environment"]["shards"])
    assert {c["id"] for c in merged["cases"]} == ran[0] | ran[1]
    assert merged["shard"]["merged"] == [1, 2] and merged["exit_code"] == 0
    assert merged["analysis"]["accuracy"]["rows"]  # the accuracy table came along
    cases = ET.parse(tmp_path / "all" / "junit.xml").getroot().iter("testcase")
    assert len(list(cases)) == len(ran[0] | ran[1])
    assert (tmp_path / "all" / "report.md").is_file() and (tmp_path / "all" / "report.html").is_file()
    r = kvdiag("report", tmp_path / "all", "--format", "table")  # and it is a run like any other
    assert r.returncode == 0 and f"OK: {len(ran[0] | ran[1])} pass" in r.stdout, r.stdout


@pytest.mark.slow
def test_a_merge_of_different_suites_or_one_shard_twice_exits_2(shard_runs, tmp_path):
    root = shard_runs
    r = kvdiag("report", "--merge", root / "s1", root / "other", "-o", tmp_path / "x")
    assert r.returncode == 2 and "different suites" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = kvdiag("report", "--merge", root / "s1", root / "s1", "-o", tmp_path / "y")
    assert r.returncode == 2 and "given twice" in r.stderr, r.stderr
    assert not (tmp_path / "x" / "results.jsonl").exists()


@pytest.mark.slow
def test_a_balanced_shard_takes_the_durations_of_an_earlier_run(shard_runs, tmp_path):
    root = shard_runs
    r = kvdiag("report", "--merge", root / "s1", root / "s2", "-o", tmp_path / "all")
    assert r.returncode == 0, r.stderr
    r = kvdiag("ci", "--config", root / "kvdiag.toml", "--shard", "2/2", "--durations", tmp_path / "all", "-o",
               tmp_path / "b2", "-q", "--format", "json")
    assert r.returncode == 0, r.stderr[-2000:]
    run = json.loads(r.stdout)
    assert run["shard"]["balanced_by"] == str(tmp_path / "all") and run["cases"]
    r = kvdiag("ci", "--config", root / "kvdiag.toml", "--durations", tmp_path / "all", "-o", tmp_path / "whole", "-q",
               "--format", "json")  # no shard: the whole suite, its longest cases first
    assert r.returncode == 0, r.stderr[-2000:]
    assert {c["id"] for c in json.loads(r.stdout)["cases"]} == full_suite_ids(root / "kvdiag.toml")
    r = kvdiag("ci", "--config", root / "kvdiag.toml", "--durations", tmp_path / "nowhere")
    assert r.returncode == 2 and r.stderr.strip().endswith("no results.jsonl there"), r.stderr
