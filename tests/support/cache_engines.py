"""Test-only engines for `kvdiag dtypes --check` (``--engine tests.support.cache_engines:factory``): the builtin engine,
out of device memory for some dtypes, and with an 'fp8' cache that is really bf16 in its last layer.

- ``float16``: start raises vLLM's ValueError "No available memory for the cache blocks" (what two vLLM engines
  starting together on one GPU can get), which the matrix must not take for "unsupported".
- ``fp8_e5m2``: start raises vLLM's memory-profiling AssertionError.
- ``fp8``: runs as fp8, but its cache tensors as ``kv_blocks()`` shows them are bf16 in the last layer, as an
  engine that quietly falls back to the model's precision for some layers would have them.
"""

from __future__ import annotations

from kvdiag.engines.builtin.engine import BuiltinEngine

NO_CACHE_MEMORY = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                   "initializing the engine.")
PROFILING = ("Error in memory profiling. Initial free memory 70.1 GiB, current free memory 60.3 GiB. This happens "
             "when other processes sharing the same container release GPU memory while vLLM is profiling during "
             "initialization. To fix this, ensure consistent GPU memory allocation or isolate vLLM in its own "
             "container.")


class CacheEngine(BuiltinEngine):
    name = "cache-test"

    def start(self, spec):
        if spec.kv_cache_dtype == "float16":
            raise ValueError(NO_CACHE_MEMORY)
        if spec.kv_cache_dtype == "fp8_e5m2":
            raise AssertionError(PROFILING)
        super().start(spec)

    def kv_blocks(self):
        view = super().kv_blocks()
        if view is None or self.spec.kv_cache_dtype != "fp8":
            return view
        from dataclasses import replace

        import torch

        last = view.layers[-1]
        bf16 = replace(last, k=last.k.to(torch.bfloat16), v=last.v.to(torch.bfloat16))
        return replace(view, layers=[*view.layers[:-1], bf16])


factory = CacheEngine
