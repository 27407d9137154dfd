"""The builtin engine against transformers' forward (the oracle), on random-weight models."""

import os

import pytest
import torch

from kvdiag.engines.base import EngineSpec
from kvdiag.engines.builtin.engine import BuiltinEngine

DEV = os.environ.get("KVDIAG_TEST_DEVICE", "cpu")
ATOL = 1e-4

# GQA everywhere; head sizes 64 and 128; Qwen2 has qkv biases and tied embeddings
MODELS = {
    "llama": dict(arch="llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64),
    "mistral": dict(arch="mistral", hidden_size=128, num_heads=4, num_kv_heads=1, head_dim=128),
    "qwen2": dict(arch="qwen2", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=128),
    "llama3-rope": dict(arch="llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def _model(random_model, name, dtype="float32"):
    kw = dict(MODELS[name])
    return random_model(kw.pop("arch"), init_std=0.15, intermediate_size=192, dtype=dtype, **kw)


def _hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEV).eval()


def _engine(path, **kw):
    e = BuiltinEngine()
    e.start(EngineSpec(model=path, device=DEV, block_size=16, num_blocks=64,
                       engine_args={"ignore_eos": True}, **kw))
    return e


@torch.no_grad()
def _hf_logprobs(hf, ids):
    return torch.log_softmax(hf(torch.tensor([ids], device=DEV)).logits[0].float(), -1).cpu()


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_matches_transformers(random_model, name):
    path = _model(random_model, name)
    hf, engine = _hf(path), _engine(path)
    contexts = _prompts([5, 17, 33, 40, 16])
    continuations = _prompts([4, 8, 7, 1, 17], seed=1)
    scored = engine.score(contexts, continuations, top_k=-1)
    for ctx, cont, s in zip(contexts, continuations, scored):
        want = _hf_logprobs(hf, ctx + cont)[len(ctx) - 1:len(ctx) + len(cont) - 1]
        assert s.distributions.shape == want.shape and s.distributions.dtype == torch.float32
        torch.testing.assert_close(s.distributions, want, atol=ATOL, rtol=0)
        assert s.logprobs == pytest.approx(want[range(len(cont)), cont].tolist(), abs=ATOL)
        assert s.is_greedy == bool((want.argmax(-1) == torch.tensor(cont)).all())
    engine.shutdown()


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_matches_transformers_across_block_boundaries(random_model, name):
    path = _model(random_model, name)
    hf, engine = _hf(path), _engine(path)
    prompts = _prompts([5, 16, 31, 40], seed=2)
    outs = engine.generate(prompts, 24, greedy=True, logprobs=2)
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
        want = _hf_logprobs(hf, prompt + out.token_ids[:-1])[len(prompt) - 1:]  # = forward on the growing sequence
        for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            top2 = want[step].topk(2).values
            if int(want[step].argmax()) != tok:  # only a float-level near tie may flip the argmax
                assert top2[0] - top2[1] < 1e-4, (name, step)
                break
            assert lp == pytest.approx(float(want[step, tok]), abs=ATOL), (name, step)
            assert set(out.top_logprobs[step]) <= set(want[step].topk(3).indices.tolist())
    engine.shutdown()


def test_bfloat16_kv_is_bit_identical_to_auto_on_a_bf16_model(random_model):
    path = _model(random_model, "qwen3", dtype="bfloat16")
    engine = _engine(path)
    assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompts = _prompts([7, 20, 33], seed=3)
    conts = _prompts([6, 6, 6], seed=4)
    runs = {}
    for kv in ("auto", "bfloat16", "float16"):
        engine.set_kv_dtype(kv)
        gen = engine.generate(prompts, 20, greedy=True)
        scored = engine.score(prompts, conts, top_k=-1)
        runs[kv] = ([g.token_ids for g in gen], [g.logprobs for g in gen], [s.distributions for s in scored])
    assert engine.weight_loads == 1
    auto, bf16, fp16 = runs["auto"], runs["bfloat16"], runs["float16"]
    assert auto[0] == bf16[0] and auto[1] == bf16[1]  # exactly equal floats
    assert all(torch.equal(a, b) for a, b in zip(auto[2], bf16[2]))
    for a, h in zip(auto[2], fp16[2]):  # float16 storage: runs and stays close
        assert torch.isfinite(h).all() and (a - h).abs().max() < 0.1
    engine.shutdown()


def test_bf16_auto_stays_close_to_transformers(random_model):
    path = _model(random_model, "llama", dtype="bfloat16")
    hf, engine = _hf(path, torch.bfloat16), _engine(path)
    ctx, cont = _prompts([21], seed=5)[0], _prompts([9], seed=6)[0]
    got = engine.score([ctx], [cont], top_k=-1)[0].distributions
    want = _hf_logprobs(hf, ctx + cont)[len(ctx) - 1:-1]
    assert (got - want).abs().max() < 0.25  # bf16 matmuls differ (CPU/CUDA, sdpa vs float32 attention)
    engine.shutdown()
