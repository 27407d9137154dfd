"""kvdiag's drift reads the KV cache, as vLLM's own decode does, on real vLLM on a CUDA GPU.

Some backends attend a request's first prefill on K/V that the cache does not hold as stored (MLA's prefill
works on the unquantized latent). A teacher-forced score of a whole prompt in one request then reads little or
none of the cache. The oracle, plain vLLM in the same process layout (tests/support/vllm_score_probe.py): the same
scores
with the context written to the prefix cache first, or computed in 16-token chunks. kvdiag's ``dtypes --check``
must read the context back from the cache for every prompt, and say so where it could not.

    KVDIAG_GPU_OUT=/some/dir python3 -m pytest -m "cuda and vllm" tests/gpu/test_vllm_score.py
"""

from __future__ import annotations

import json

import pytest
from probes import plain_probe
from test_vllm_gpu import FAST, OUT, kvdiag, pytestmark, shim_args  # noqa: F401 - GPU marks apply too

from kvdiag.models import zoo

PREFIX_CACHING = ("-a", "enable_prefix_caching=true")
CASES = [("tiny-llama", "turboquant_k8v4"), ("zoo:deepseek-v2", "fp8")]


def model_path(model: str) -> str:
    from kvdiag.assets import TINY_MODEL

    return str(TINY_MODEL if model == "tiny-llama" else zoo.resolve(model))


def score_probe(path: str, kv_dtype: str) -> dict:
    return plain_probe("vllm_score_probe.py", path, kv_dtype, *shim_args(path), timeout=600)


def max_delta(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def check(model: str, kv_dtype: str, *args: str) -> dict:
    """kvdiag's ``dtypes --check`` of auto and ``kv_dtype``: the case of ``kv_dtype``."""
    path = model_path(model)
    name = f"score-{model.replace(':', '-')}-{kv_dtype}{'-pc' if args else ''}"
    _, run, _ = kvdiag(name, "dtypes", "--check", "-e", "vllm", "-m", model if model != "tiny-llama" else path,
                       "-d", "auto", "-d", kv_dtype, *FAST, *args)
    return next(c for c in run["cases"] if c["kv_dtype"] == kv_dtype)


def truth_of(model: str, kv_dtype: str) -> dict:
    """The probe's two dtypes compared: max |Δ logprob| of the continuation tokens in one prefill and through the
    cache, whether greedy decoding kept auto's tokens, and each prompt's prefix-cache hit."""
    path = model_path(model)
    base, test = score_probe(path, "auto"), score_probe(path, kv_dtype)
    truth = {"single": max_delta(base["single"], test["single"]), "cached": max_delta(base["cached"], test["cached"]),
             "decode_same_tokens": base["decode_tokens"] == test["decode_tokens"], "hits": test["hit"],
             "context_tokens": test["context_tokens"]}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"score-probe-{model.replace(':', '-')}-{kv_dtype}.json").write_text(json.dumps(truth))
    return truth


@pytest.mark.parametrize("model,kv_dtype", CASES)
def test_drift_reads_the_context_from_the_cache_and_sees_what_vllms_cached_scores_see(model, kv_dtype):
    truth = truth_of(model, kv_dtype)
    assert all(h > 0 for h in truth["hits"]), f"vLLM read no prefix cache: {truth}"
    assert truth["cached"] > 0, f"the cached scores of {kv_dtype} equal auto's: nothing for drift to see ({truth})"

    case = check(model, kv_dtype)
    d = case["metrics"]["drift"]
    assert d["context_from_cache"] == 1.0, d  # deepseek-v2's one context shorter than its 64-token block: chunks
    assert not d["identical"] and d["max_abs_dlogprob"] > 0, (truth, d)
    assert "drift_uncached" not in [f["kind"] for f in case["findings"]]


def test_the_hybrid_s_drift_reads_its_context_in_chunks_and_sees_what_one_prefill_hides():
    """zoo:granite-hybrid, turboquant_k8v4: in one prefill vLLM's scores are auto's to the bit, through the cache
    they are not. Its KV blocks hold 512 tokens and vLLM 0.24 turns prefix caching off for hybrid models, so no
    drift context (32-182 tokens) can come from the prefix cache. Plain vLLM started with
    ``long_prefill_token_threshold=16`` computes each prompt in 16-token chunks that read the chunks before from the
    cache: turboquant's scores move. kvdiag's drift scores that way (its scheduler's threshold at 16 for its scoring
    requests: the chunk of a context under 256 tokens, engines/vllm/scoring.py): every prompt reads its context
    back and the drift moves, with prefix caching off (vLLM's default) and forced on."""
    path = model_path("zoo:granite-hybrid")
    truth = truth_of("zoo:granite-hybrid", "turboquant_k8v4")
    assert truth["single"] == 0 < truth["cached"], truth
    assert all(h == 0 for h, n in zip(truth["hits"], truth["context_tokens"]) if n <= 512), truth
    chunked = [plain_probe("vllm_score_probe.py", path, d, *shim_args(path), "long_prefill_token_threshold=16",
                           timeout=600)["single"] for d in ("auto", "turboquant_k8v4")]
    assert max_delta(*chunked) > 0, "turboquant's chunked scores equal auto's: nothing for drift to see"

    for args in ((), PREFIX_CACHING):  # prefix caching forced on: vLLM 0.24 still serves no context of 512 tokens
        case = check("zoo:granite-hybrid", "turboquant_k8v4", *args)
        drift = case["metrics"]["drift"]
        assert drift["context_from_cache"] == 1.0 and not drift["identical"] and drift["max_abs_dlogprob"] > 0, drift
        assert "drift_uncached" not in [f["kind"] for f in case["findings"]], args
