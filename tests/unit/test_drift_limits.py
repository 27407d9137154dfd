"""Drift limits come from the dtype registry (kvdiag/dtypes.py): every kv dtype kvdiag can meet has limits, and
each dtype gets the limits it had before the registry held them (the table below was computed from the hand-typed
names drift.family used at ee87bea)."""

import importlib.util

import pytest

from kvdiag import dtypes
from kvdiag.checks.sweep import drift

# family -> (mean KL, max KL, min top-1 agreement, max |d logprob|, bit-identical required), as calibrated
OLD_LIMITS = {
    "identical": (0.0, 0.0, 1.0, 0.0, True),
    "recompiled": (1e-4, 2e-3, 0.99, 0.5, False),  # the identical family on a compiled engine
    "unquantized": (2e-3, 0.1, 0.95, 1.0, False),
    "fp8_e4m3": (0.02, 1.0, 0.9, 4.0, False),
    "fp8_e5m2": (0.06, 4.0, 0.8, 5.0, False),
    "int8_per_token_head": (2e-3, 0.1, 0.95, 1.0, False),
    "fp8_per_token_head": (0.02, 1.0, 0.9, 4.0, False),
    "quantized": (0.06, 4.0, 0.8, 5.0, False),
}
# kv dtype -> the family drift.family gave it for a model of another dtype (the builtin names, their aliases, vLLM
# 0.32's CacheDType names, torch's names, an unknown name)
OLD_FAMILY = {
    "auto": "identical", "bfloat16": "unquantized", "float16": "unquantized", "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8_per_token_head": "int8_per_token_head",
    "fp8_per_token_head": "fp8_per_token_head",
    **dict.fromkeys(("bf16", "fp16", "half", "float32", "float"), "unquantized"),
    **dict.fromkeys(("e4m3", "e5m2", "int8", "int8pth", "int8_pth", "fp8pth", "fp8_pth", "fp8_inc", "fp8_ds_mla",
                     "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                     "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "nvfp4", "nvfp4_4over6",
                     "fp4_new_thing"), "quantized"),
}
IDENTICAL_ON = {"bfloat16": "bfloat16", "float16": "float16"}  # bit-identical to auto on a model of that dtype


def _limits(lim: drift.Limits) -> tuple:
    return lim.mean_kl, lim.max_kl, lim.min_top1, lim.max_abs_dlogprob, lim.identical


def _missing(names) -> list[str]:
    return [n for n in names if dtypes.drift_family(n) not in drift.FAMILY_LIMITS]


def test_every_builtin_dtype_has_drift_limits():
    assert _missing(dtypes.BUILTIN_DTYPES) == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_every_vllm_cache_dtype_has_drift_limits():
    """A dtype a newer vLLM adds fails here until kvdiag/dtypes.py says which limits it gets."""
    from kvdiag.engines.vllm import adapt

    names = adapt.cache_dtypes()
    assert "fp8" in names and len(names) > 5
    assert _missing(names) == [], "add these to kvdiag/dtypes.py (OTHER_ENGINE_DTYPES) with their drift family"


def test_a_dtype_added_without_limits_is_found(monkeypatch):
    new = dtypes.KVDType("fp6_e3m2", "uint8", "per_tensor", 28.0)
    monkeypatch.setitem(dtypes.BUILTIN_DTYPES, new.name, new)
    assert _missing(dtypes.BUILTIN_DTYPES) == ["fp6_e3m2"]


def test_limits_per_family_unchanged():
    assert {k: _limits(v) for k, v in drift.FAMILY_LIMITS.items()} == OLD_LIMITS


@pytest.mark.parametrize("model_dtype", [None, "bfloat16", "float16", "float32"])
def test_each_dtype_gets_the_limits_it_had(model_dtype):
    got = {n: drift.family(n, model_dtype) for n in OLD_FAMILY}
    want = {n: "identical" if n in IDENTICAL_ON and IDENTICAL_ON[n] == model_dtype else f
            for n, f in OLD_FAMILY.items()}
    assert got == want
    for n in OLD_FAMILY:
        assert _limits(drift.limits_for(n, model_dtype)) == OLD_LIMITS[want[n]]
        compiled = "recompiled" if want[n] == "identical" else want[n]  # only the identical family changes
        assert _limits(drift.limits_for(n, model_dtype, compiled=True)) == OLD_LIMITS[compiled]


# drift.compare's totals from vLLM 0.24 (docs/vllm-gpu-results.md, "Figures behind the code")
COMPILED_BF16_VS_AUTO = dict(identical=False, mean_kl=3.2e-6, max_kl=2.46e-4, top1_agreement=1.0,
                             max_abs_dlogprob=0.0567, first_divergence=None)  # zoo:qwen3 compiled
S1_FAULT = dict(identical=False, mean_kl=7.56e-4, max_kl=9.97e-3, top1_agreement=1.0, max_abs_dlogprob=0.261,
                first_divergence={"prompt": 1, "position": 6})  # explicit_bf16_as_fp8 on tiny-llama


def test_a_compiled_engines_own_dtype_may_differ_by_compile_noise_but_not_by_the_s1_fault():
    """Compiled, vLLM compiles and autotunes each kv dtype apart: `bfloat16` on a bf16 model may be bit-identical
    to `auto` or off by compile noise. Eager stays exact; compiled, that noise passes and the S1 fault
    (bfloat16 silently run as fp8) still fails, on both KL limits."""
    eager = drift.limits_for("bfloat16", "bfloat16")
    compiled = drift.limits_for("bfloat16", "bfloat16", compiled=True)
    assert drift.judge(COMPILED_BF16_VS_AUTO, eager) and not drift.judge(COMPILED_BF16_VS_AUTO, compiled)
    problems = drift.judge(S1_FAULT, compiled)
    assert [p.split()[0] for p in problems] == ["mean_kl", "max_kl"], problems


def test_the_compiled_flag_of_either_record_picks_the_recompiled_limits():
    class Rec:
        def __init__(self, compiled):
            self.metrics = {"compiled": compiled}

    assert drift.compiled_pair(Rec(True), Rec(False)) and drift.compiled_pair(Rec(False), Rec(True))
    assert not drift.compiled_pair(Rec(False), Rec(None))


def test_a_vllm_engine_is_compiled_unless_eager_or_compilation_off():
    """vLLM 0.24 sets compilation mode NONE (0) for enforce_eager; its defaults compile (VLLM_COMPILE, 3)."""
    from types import SimpleNamespace as NS

    from kvdiag.engines.vllm.adapt import compiles

    def llm(eager, mode):
        cfg = NS(model_config=NS(enforce_eager=eager), compilation_config=NS(mode=mode))
        return NS(llm_engine=NS(vllm_config=cfg))

    assert compiles(llm(False, 3)) and not compiles(llm(True, 0)) and not compiles(llm(False, 0))
    assert not compiles(NS(llm_engine=NS()))  # a vLLM without vllm_config on its engine: eager, as before
