"""Imported once by the workers' fork server (``kvdiag.run.runner``) for a run of vLLM cases: vLLM, the modules an
engine start imports, transformers and lm_eval. Every worker is forked from that server, so a case starts with them
instead of paying ~20 s of imports. Nothing here may initialise CUDA (a forked CUDA context is unusable):
``cuda_untouched()`` says whether that held, and the GPU tests assert it.

It also inspects the run's model architectures once (``warm_model_info``): vLLM inspects a model class the first
time a machine sees it in a subprocess of its own that imports vLLM again (its cache, ``~/.cache/vllm/modelinfos``,
serves later runs). Without that cache every case paid for it (docs/vllm-gpu-results.md), the cases whose dtype
no backend takes included (they are decided by vLLM's config checks, which inspect the model first).
"""

from __future__ import annotations

import importlib

from kvdiag.engines.vllm.engine import import_vllm
from kvdiag.engines.vllm.server_env import run_models
from kvdiag.models import config

# Imported by vllm.LLM() and the first generate; each is optional (vLLM moves them between releases).
MODULES = ("vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
           "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
           "vllm.v1.worker.gpu.model_runner",
           "vllm.model_executor.models.llama", "vllm.model_executor.model_loader",
           "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
           "vllm.v1.sample.sampler", "transformers", "lm_eval.evaluator")
# kvdiag's own modules (the checks, the lm_eval adapter) are the fork server's preload for every engine
# (kvdiag.run.scheduling.preload), not named here: this layer may not import them.

import_vllm()
for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - not in this vLLM, or not on this platform: the worker imports what it needs
        pass


def cuda_untouched() -> bool:
    """True when no CUDA context exists in this process (torch's lazy init has not run)."""
    import torch

    return not torch.cuda.is_initialized()


def warm_model_info(models: list[str]) -> list[str]:
    """Inspect the architectures of ``models`` (local folders) as vLLM's registry does, in this process instead of
    the subprocess vLLM starts for an architecture it has not cached: the result is in the registry's in-memory
    cache, which every forked worker inherits, and in vLLM's file cache. Importing a model class touches no CUDA
    (vLLM's own reason for the subprocess is caution); ``cuda_untouched`` is checked by the GPU tests. Returns the
    architectures inspected; quiet on any failure (the worker's engine start then inspects as vLLM does)."""
    try:
        from vllm.model_executor.models import registry
    except Exception:  # noqa: BLE001 - another vLLM layout: nothing warmed
        return []
    archs = []
    for model in models:
        archs += config(model).get("architectures") or []
    done, in_subprocess = [], getattr(registry, "_run_in_subprocess", None)
    registry._run_in_subprocess = lambda fn: fn()
    try:
        for arch in dict.fromkeys(archs):
            try:
                if registry.ModelRegistry._try_inspect_model_cls(arch) is not None:
                    done.append(arch)
            except Exception:  # noqa: BLE001
                pass
    finally:
        registry._run_in_subprocess = in_subprocess
    return done


WARMED = warm_model_info(run_models())
