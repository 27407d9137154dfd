"""Test-only third-party engines built on the builtin engine (``--engine tests.support.corrupt_engine:<name>``).

``factory``: attention dequantizes K with V's per-token-head scales (a scale-cache mix-up,
the mirror image of issue 10's ``v_dequant_with_k_scales`` fault) - in layer 0 only for
int8_per_token_head (the shipped model loses about a third of its recall: a regression)
and in every layer for fp8_per_token_head (recall falls to chance: a collapse). Every
other dtype is the clean builtin engine. It also proves ``--engine module:factory`` works
end to end.
"""

from __future__ import annotations

import os

from kvdiag.engines.builtin.engine import BuiltinEngine
from kvdiag.kernels import dispatch

CORRUPT_LAYERS = {"int8_per_token_head": {0}, "fp8_per_token_head": None}  # None: every layer


class CorruptEngine(BuiltinEngine):
    name = "corrupt-test"

    def _allocate_kv(self, rebuild_tables: bool = True) -> None:
        super()._allocate_kv(rebuild_tables)
        dtype = self.spec.kv_cache_dtype
        if dtype not in CORRUPT_LAYERS:
            return
        kv, clean = self.kv, self.kv.attend
        layers = CORRUPT_LAYERS[dtype] or set(range(kv.num_layers))

        def attend(layer, q, meta, scale):
            if layer not in layers:
                return clean(layer, q, meta, scale)
            c = kv.views[layer]
            return dispatch.paged_attention(q, c.k, c.v, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                            scale, kv.kv_dtype, kv.k_scales[layer], kv.v_scales[layer],
                                            c.v_scale, c.v_scale)  # K read with V's scales

        kv.attend = attend


factory = CorruptEngine


class MatrixEngine(BuiltinEngine):
    """One failure of each kind for `kvdiag dtypes --check`: fp8_e5m2 is refused at start in the engine's
    own words, fp8_per_token_head aborts the process in its first forward, and an explicit 'bfloat16' is
    mis-dispatched to fp8 storage (bug S1's shape: it runs, but is not bit-identical to auto)."""

    name = "matrix-test"

    def start(self, spec):
        if spec.kv_cache_dtype == "fp8_e5m2":
            from kvdiag.errors import EngineUnsupported

            raise EngineUnsupported("fp8_e5m2 KV cache needs compute capability >= 8.9")
        if spec.kv_cache_dtype == "bfloat16":
            from dataclasses import replace

            spec = replace(spec, kv_cache_dtype="fp8")
        super().start(spec)

    def _forward(self, entries, **kw):
        if self.spec.kv_cache_dtype == "fp8_per_token_head":
            os.abort()
        return super()._forward(entries, **kw)


matrix_factory = MatrixEngine
