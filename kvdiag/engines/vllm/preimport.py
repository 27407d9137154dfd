"""Imported once by the workers' fork server (``kvdiag.run.runner``) for a run of vLLM cases: vLLM, the modules an
engine start imports, transformers and lm_eval. Every worker is forked from that server, so a case starts with them
instead of paying ~20 s of imports. Nothing here may initialise CUDA (a forked CUDA context is unusable):
``cuda_untouched()`` says whether that held, and the GPU tests assert it.
"""

from __future__ import annotations

import importlib

from kvdiag.engines.vllm.engine import import_vllm

# Imported by vllm.LLM() and the first generate; each is optional (vLLM moves them between releases).
MODULES = ("vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
           "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
           "vllm.model_executor.models.llama", "vllm.model_executor.model_loader",
           "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
           "vllm.v1.sample.sampler", "transformers", "lm_eval.evaluator", "kvdiag.evaluation.lm_eval_adapter")

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
