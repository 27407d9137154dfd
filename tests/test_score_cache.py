"""Scores read through the KV cache: vLLM's prompt logprobs placed after a prefix-cache hit, and the drift's
warning when a quantized dtype's scores did not read the cache (no GPU, no vLLM: fakes of vLLM's outputs in the
two layouts its model runners return; tests/test_vllm_engine.py and tests/test_vllm_score.py run the real one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvdiag.checks import drift
from kvdiag.engines.vllm import adapt


def row(token: int, lp: float) -> dict:
    return {token: SimpleNamespace(logprob=lp, rank=1)}


def output(n_ctx: int, cont: list[int], hit: int, *, runner: str) -> SimpleNamespace:
    """Prompt logprobs of context + continuation as vLLM returns them after a hit of ``hit`` tokens: the V1 runner
    a full-length list whose rows before the hit are unset, model runner V2 only the computed rows."""
    real = [None] + [row(7, -0.5)] * (n_ctx - 1) + [row(t, -float(j + 1)) for j, t in enumerate(cont)]
    if runner == "v1":
        rows = [None] + [row(-1, 1e30)] * hit + real[hit + 1:] if hit else real
    else:
        rows = [None] + real[hit + 1:]
    return SimpleNamespace(prompt_logprobs=rows, num_cached_tokens=hit)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("hit", [0, 16, 32])
def test_the_continuation_is_found_after_any_hit_in_either_runner_s_layout(runner, hit):
    s = adapt.scored(output(40, [3, 4, 5], hit, runner=runner), 40, [3, 4, 5], 0)
    assert s.logprobs == [-1.0, -2.0, -3.0] and s.context_from_cache == hit


def test_a_hit_into_the_continuation_is_refused_not_misread():
    with pytest.raises(RuntimeError, match="cannot place the continuation"):
        adapt.scored(output(40, [3, 4, 5], 40, runner="v2"), 40, [3, 4, 5], 0)


def drift_of(share):
    return {"by_position": {}, "context_from_cache": share}


def test_a_quantized_dtype_scored_mostly_without_the_cache_is_warned_about():
    fp8 = drift.limits_for("fp8", "bfloat16")
    (kind, msg, evidence), = drift.warnings(drift_of(0.25), fp8)
    assert kind == "drift_uncached" and "for 25% of the prompts" in msg and evidence == {"context_from_cache": 0.25}
    assert drift.warnings(drift_of(0.0), fp8)[0][0] == "drift_uncached"  # a hybrid model on vLLM: blocks of 512
    assert drift.warnings(drift_of(drift.MIN_FROM_CACHE), fp8) == []  # e.g. 7 of 8: one context under a block
    assert drift.warnings(drift_of(None), fp8) == []  # an engine that does not say (the builtin)
    assert drift.warnings(drift_of(0.0), drift.limits_for("bfloat16", "bfloat16")) == []  # nothing to quantize


def test_the_share_counts_prompts_whose_context_came_from_the_cache():
    assert drift.from_cache({"from_cache": [0, 16, 32, None]}) == pytest.approx(2 / 3)
    assert drift.from_cache({"from_cache": [None, None]}) is None
    assert drift.from_cache({}) is None
