"""A stand-in for lm_eval's ``simple_evaluate`` with its vLLM backend, for the score-regression reproducer's own
tests (tests/unit/test_proof_accuracy.py): put on PYTHONPATH of the script's process only, beside the stand-in vLLM.
Each document asked for scores 1.0 (acc); under ``FAKE_LM_EVAL_FAULT=flip`` an fp8 cache scores the odd ones 0.0."""

from __future__ import annotations

import os

CALLS = []


def simple_evaluate(model, model_args, tasks, task_manager, log_samples, samples, **settings):
    assert model == "vllm" and log_samples and list(samples) == list(tasks)
    from vllm import LLM  # the engine starts as lm_eval's backend starts it: the stand-in refuses what vLLM would

    LLM(model=model_args["pretrained"], **{k: v for k, v in model_args.items() if k != "pretrained"})
    flip = os.environ.get("FAKE_LM_EVAL_FAULT") == "flip" and "fp8" in str(model_args.get("kv_cache_dtype"))
    return {"samples": {tasks[0]: [{"doc_id": d, "filter": "none", "metrics": ["acc"],
                                    "acc": 0.0 if flip and d % 2 else 1.0} for d in samples[tasks[0]]]}}
