"""A fault in how vLLM resolves the kv cache dtype string (bug class S1); ``dtypes --check`` must catch it."""

from __future__ import annotations

from kvdiag.engines.vllm.faults.patching import CodePoint, fire, wrap

RESOLVE = CodePoint("vllm.engine.arg_utils", "resolve_kv_cache_dtype_string")
BF16_AS_FP8 = "explicit_bf16_as_fp8"


def explicit_bf16_as_fp8(kv_cache_dtype: str | None = None) -> list[str]:
    """S1, vLLM #38922: an explicit ``bfloat16`` cache takes a quantized path.

    The fix: #38922 ("Fix broken explicit unquantized kv cache dtype support") made ``--kv-cache-dtype bfloat16``
    (and the other explicit unquantized names) work again, as ``auto`` does on a bf16 model; before it, the explicit
    name failed in the cache update (``reshape_and_cache_flash``, in the PR's traceback). Its diff was not read here;
    the code point is where vLLM turns the name into the cache's dtype for the engine's ``CacheConfig``:
    ``resolve_kv_cache_dtype_string`` as ``EngineArgs.create_engine_config`` calls it (``vllm/engine/arg_utils.py``).
    Versions: vLLM 0.24, 0.32. The fault:
    ``bfloat16`` resolves to ``fp8`` (fires each time it does): the cache is allocated and written as fp8 while
    ``auto`` stores bf16. Not applicable to other dtypes (they resolve as before).

    Intended check: ``dtypes --check``, finding ``wrong`` (an explicit unquantized dtype equal to the model's is not
    bit-identical to ``auto``; or, where this platform refuses fp8, refused while ``auto`` starts); ``accuracy``'s
    drift sees it too.

    Outside kvdiag: ``apply(["explicit_bf16_as_fp8"])`` before ``vllm.LLM(..., kv_cache_dtype="bfloat16")``.
    """
    def make(original):
        def resolve_kv_cache_dtype_string(kv_cache_dtype, *args, **kwargs):
            if kv_cache_dtype == "bfloat16":
                fire(BF16_AS_FP8)
                return "fp8"
            return original(kv_cache_dtype, *args, **kwargs)
        return resolve_kv_cache_dtype_string
    wrap(RESOLVE, BF16_AS_FP8, make)
    return [str(RESOLVE)]
