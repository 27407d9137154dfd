"""A new check is one folder and one registry line: tests/support/toy_kvcheck/ installed as a plug-in (the
``kvdiag.checks``
entry point, as a third-party package would) shows in --help, gets a command with its own options, runs, is a
table of `kvdiag ci` with its keys validated, and shows in `kvdiag report` (its own table and plot in report.html)
and `kvdiag compare` by its own rules; no file of kvdiag is edited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TOY = Path(__file__).resolve().parents[1] / "support" / "toy_kvcheck"  # the check's folder


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    """A folder that holds the toy package and its dist-info with the entry point, on PYTHONPATH."""
    from plugins import install

    env = {**install(tmp_path_factory.mktemp("plugin"), "toy_kvcheck", TOY, "kvdiag.checks", "toy = toy_kvcheck:Toy"),
           "COLUMNS": "200"}
    return env


def kvdiag(env, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_the_toy_check_has_a_command_with_its_own_options(plugin):
    top = kvdiag(plugin, "--help")
    assert top.returncode == 0 and "toy" in top.stdout and "Count rounds, the toy way." in top.stdout, top.stdout
    own = kvdiag(plugin, "toy", "--help")
    assert own.returncode == 0, own.stderr
    for words in ("--rounds", "How many rounds the toy counts.", "--mood", "calm", "loud", "--kv-dtype", "--engine"):
        assert words in own.stdout, (words, own.stdout)
    bad = kvdiag(plugin, "toy", "--rounds", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--rounds" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_the_toy_check_runs_reports_and_compares(plugin, tmp_path):
    ok = kvdiag(plugin, "toy", "-d", "auto", "--rounds", "3", "--mood", "loud", "-o", str(tmp_path / "a"))
    assert ok.returncode == 0, ok.stderr
    assert "TOY TABLE auto: 3 rounds, loud" in ok.stdout, ok.stdout  # the check's own table
    again = kvdiag(plugin, "report", str(tmp_path / "a"), "--format", "table")
    assert "TOY TABLE auto: 3 rounds, loud" in again.stdout, again.stdout
    md = kvdiag(plugin, "report", str(tmp_path / "a"), "--format", "md")
    assert "toy/builtin/tiny-llama/auto" in md.stdout, md.stdout
    assert "toy: rounds per kv dtype" in md.stdout, md.stdout  # its tables(), laid out by report/
    html = kvdiag(plugin, "report", str(tmp_path / "a"), "--format", "html").stdout
    assert "<h2>toy: rounds per kv dtype</h2>" in html and "<td>loud</td>" in html, html  # its table
    assert "toy rounds per kv dtype" in html and "<svg" in html, html  # its plot

    bad = kvdiag(plugin, "toy", "-d", "auto", "--rounds", "5", "-o", str(tmp_path / "b"), "--format", "json")
    assert bad.returncode == 1, bad.stderr
    case = json.loads(bad.stdout)["cases"][0]
    assert case["status"] == "fail" and case["params"]["rounds"] == 5 and case["params"]["mood"] == "calm", case

    cmp = kvdiag(plugin, "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--format", "json")
    assert cmp.returncode == 1, cmp.stderr
    rows = {r["what"]: r for r in json.loads(cmp.stdout)["rows"]}
    assert rows["toy rounds"]["old"] == 3 and rows["toy rounds"]["new"] == 5, rows
    assert rows["toy rounds"]["verdict"] == "regression"


def test_the_toy_check_is_a_table_of_the_ci_config(plugin, tmp_path):
    cfg = tmp_path / "kvdiag.toml"
    cfg.write_text(textwrap.dedent("""\
        kv_dtypes = ["auto"]
        [toy]
        rounds = 2
        bogus = 1
    """))
    bad = kvdiag(plugin, "ci", "--config", str(cfg))
    assert bad.returncode == 2 and f"{cfg}:4: unknown key 'bogus' in [toy]" in bad.stderr, bad.stderr
    assert "rounds" in bad.stderr and "mood" in bad.stderr, bad.stderr
    cfg.write_text('kv_dtypes = ["auto"]\n[toy]\nrounds = 2\nmood = "shy"\n')
    shy = kvdiag(plugin, "ci", "--config", str(cfg))
    assert shy.returncode == 2 and "'mood' = 'shy': expected one of calm, loud" in shy.stderr, shy.stderr
    cfg.write_text('kv_dtypes = ["auto"]\n[toy]\nrounds = 2\n')
    run = kvdiag(plugin, "ci", "--config", str(cfg), "-o", str(tmp_path / "ci"), "--format", "json")
    assert run.returncode == 0, run.stderr
    (case,) = json.loads(run.stdout)["cases"]
    assert case["check"] == "toy" and case["metrics"] == {"rounds": 2, "mood": "calm"}, case
    report = (tmp_path / "ci" / "report.md").read_text()
    assert "toy/builtin/tiny-llama/auto" in report


def test_a_broken_plugin_is_one_warning_not_a_broken_kvdiag(plugin, tmp_path):
    broken = tmp_path / "broken"
    info = broken / "bad_kvcheck-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-kvcheck\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvdiag.checks]\nbad = no_such_module:CHECK\n")
    env = dict(plugin, PYTHONPATH=os.pathsep.join([str(broken), plugin["PYTHONPATH"]]))
    out = kvdiag(env, "--help")
    assert out.returncode == 0 and "toy" in out.stdout, out.stderr
    assert "check plug-in 'bad'" in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_kvdiags_own_checks_are_in_the_registry_with_their_defaults_once():
    from dataclasses import fields

    from kvdiag.checks.registry import checks, toml_schema

    found = checks()
    assert list(found)[:5] == ["accuracy", "dtypes", "memleak", "wake-cycle", "poison"]
    assert set(toml_schema(found["memleak"])) == {"cycles", "threshold_mib", "max_tokens", "kv_sizes"}
    assert set(toml_schema(found["wake-cycle"])) == {"levels", "staged", "cycles", "max_tokens", "logprob_tol", "seed"}
    for check in found.values():
        for f in check.option_fields():
            assert f.metadata["help"], (check.name, f.name)
    assert {f.name for f in fields(found["dtypes"].params)} == {"max_kl", "min_top1"}


def test_kvdiags_own_check_commands_are_made_from_the_registry(capsys):
    """memleak, wake-cycle and poison have no command module: their options and --help come from the registry."""
    from kvdiag.checks.registry import get
    from kvdiag.cli.app import main

    for name, flags in (("memleak", ["--cycles", "--threshold", "--max-tokens"]),
                        ("wake-cycle", ["--level", "--staged", "--logprob-tol", "--isolate"]),
                        ("poison", ["--value", "nan|inf|max|random", "--seed", "--isolate"])):
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and " ".join(get(name).help.split()[:6]) in " ".join(out.split()), out
        for flag in flags:
            assert flag in out, (name, flag, out)
        for f in get(name).option_fields():
            assert f.metadata["help"].split()[0] in out, (name, f.name)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run without -o would land in ./reports
