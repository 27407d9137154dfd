"""A new engine is one module and one registration (issue 30): a toy engine installed as a plug-in (the
``kvdiag.engines`` entry point, as a third-party package would) is listed, checked, scheduled and reported from what
its own module says (its dtypes, the -a keys it takes, what its workers' fork server imports, the GPUs one engine
spans, what it needs beside others on a GPU, the versions a report names); no file of kvdiag is edited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOY = '''
import os

from kvdiag.engines.builtin.engine import BuiltinEngine

with open(os.path.join(os.environ["TOY_MARKS"], f"imported-{os.getpid()}"), "w"):
    pass  # who imported this module: the workers' fork server (PRELOAD), or each worker itself


class ToyEngine(BuiltinEngine):
    """The builtin engine under another name, saying what an engine tells kvdiag before it starts."""

    name = "toy"
    PRELOAD = ("torch", "toy_kvengine")
    SPAN_ARGS = ("shards",)

    @staticmethod
    def engine_arg_names():
        return ["shards", "max_model_len"]

    @staticmethod
    def shared_gpu_bytes(model, engine_args, weights):
        return 1 << 30

    @staticmethod
    def report_versions(environment):
        return {"toy_engine": "9.9"}

    def start(self, spec):
        spec.engine_args = {k: v for k, v in spec.engine_args.items() if k != "shards"}
        return super().start(spec)
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    from plugins import install

    root = tmp_path_factory.mktemp("engine_plugin")
    marks = root / "marks"
    marks.mkdir()
    env = install(root, "toy_kvengine", TOY, "kvdiag.engines", "toy = toy_kvengine:ToyEngine")
    return {**env, "TOY_MARKS": str(marks), "CI": "true", "HF_HUB_OFFLINE": "1"}


def kvdiag(env, *args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_a_plugin_engine_runs_and_is_reported_from_its_own_module(plugin, tmp_path):
    r = kvdiag(plugin, "dtypes", "-e", "toy", "-f", "json")
    assert r.returncode == 0 and "fp8" in {d["name"] for d in json.loads(r.stdout)["kv_dtypes"]}, r.stderr[-2000:]
    out = tmp_path / "run"
    r = kvdiag(plugin, "accuracy", "-e", "toy", "-d", "auto", "-d", "fp8", "--limit", "3", "-t", "kv_recall",
               "-a", "shards=1", "-o", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads((out / "run.json").read_text())["cases"]
    assert [c["engine"] for c in cases] == ["toy", "toy"] and {c["status"] for c in cases} == {"pass"}
    importers = {int(p.name.split("-")[1]) for p in Path(plugin["TOY_MARKS"]).glob("imported-*")}
    workers = {c["metrics"]["worker"]["pid"] for c in cases}
    assert importers and not importers & workers  # imported once, by the fork server the workers came from
    r = kvdiag(plugin, "report", str(out), "--write")
    assert r.returncode == 0 and "toy_engine 9.9" in (out / "report.md").read_text().replace("`", ""), r.stderr
    r = kvdiag(plugin, "accuracy", "-e", "toy", "-d", "auto", "-a", "shardz=2", "-o", str(tmp_path / "bad"))
    assert r.returncode == 2 and "shards" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_scheduler_asks_the_plugin_engine(plugin, monkeypatch):
    """The GPUs an engine spans and what it needs beside others come from its module, not from kvdiag's code."""
    import importlib

    monkeypatch.syspath_prepend(plugin["PYTHONPATH"].split(os.pathsep)[0])
    monkeypatch.setenv("TOY_MARKS", plugin["TOY_MARKS"])
    importlib.invalidate_caches()
    from kvdiag.engines.base import gpus_spanned, preload_modules, shared_gpu_bytes, span_args

    assert gpus_spanned("toy", {"shards": 4}) == 4 and span_args("toy") == ("shards",)
    assert preload_modules("toy") == ("torch", "toy_kvengine")
    assert shared_gpu_bytes("toy", "m", {}, 0) == 1 << 30


@pytest.mark.slow
def test_every_check_forks_its_workers_from_the_server_that_preloaded_the_engine(plugin, tmp_path):
    """memleak and wake-cycle cases, like accuracy's, start in a worker forked from the fork server that imported
    the engine's PRELOAD once (for vLLM: ~20 s of imports a case saved): three cases, and the engine's module
    imported by kvdiag itself and the fork server only, never by a worker."""
    marks = Path(plugin["TOY_MARKS"])
    for args in (["memleak", "--cycles", "1", "--max-tokens", "2"], ["wake-cycle", "-n", "1", "--max-tokens", "2"]):
        for p in marks.glob("imported-*"):
            p.unlink()
        r = kvdiag(plugin, *args, "-e", "toy", "-d", "auto", "-d", "fp8", "-d", "int8", "-o", str(tmp_path / args[0]))
        assert r.returncode == 0, r.stderr[-3000:]
        cases = json.loads((tmp_path / args[0] / "run.json").read_text())["cases"]
        assert len(cases) == 3 and {c["status"] for c in cases} == {"pass"}, cases
        assert len(list(marks.glob("imported-*"))) == 2, (args[0], sorted(p.name for p in marks.glob("imported-*")))
