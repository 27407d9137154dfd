"""The paged KV cache: per-layer tensors, fp8 scales, and the derived tables attention reads through.

Per layer (docs/DESIGN.md, "Cache layout"): K and V ``[num_blocks, block_size, num_kv_heads, head_size]``
in the registry's storage dtype, plus float32 ``[num_blocks, block_size, num_kv_heads]``
scale caches for the per-token-head dtypes. Per-tensor fp8 scales are float32
``[num_layers]`` tensors (``k_scales``/``v_scales``).

Writes go to ``layers`` (the allocation); attention reads through ``views``, a per-layer
list of views built by :meth:`build_tables` together with a pointer/stride table (what
vLLM keeps for its kernels). Both are derived from the allocation and must be rebuilt
whenever it changes (fault ``stale_views_after_wake`` skips that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.dtypes import BUILTIN_DTYPES
from kvdiag.engines.protocol import KVLayer
from kvdiag.kernels import dispatch

# decode splits of 512 context tokens (vLLM's partition size): each token's attention then depends on its own
# context only, so eager steps and the decode CUDA graphs (cuda_graph.py) give the same bits
SPLIT_TOKENS = 512


@dataclass
class AttnMetadata:
    """One packed batch: what store_kv and paged_attention need besides the cache."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int, num_blocks: int,
                 kv_dtype: str, model_dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_dtype = kv_dtype
        self.spec = BUILTIN_DTYPES[kv_dtype]
        self.storage = self.spec.torch_dtype(model_dtype)
        self.device = device
        self.whole_page_reads = False  # fault whole_page_reads (S3)
        self.v_with_k_scales = False  # fault v_with_k_scales: V dequantized with K's scales
        self.layers: list[KVLayer] = []
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self.views: list[KVLayer] = []
        self.ptr_table: torch.Tensor | None = None  # int64 [num_layers, 4]: K, V, K scale, V scale data_ptr
        self.stride_table: torch.Tensor | None = None  # int64 [num_layers, 4]: K's strides

    @staticmethod
    def block_bytes(num_layers, num_kv_heads, head_size, block_size, kv_dtype, model_dtype) -> int:
        spec = BUILTIN_DTYPES[kv_dtype]
        elem = torch.empty(0, dtype=spec.torch_dtype(model_dtype)).element_size()
        per_layer = 2 * block_size * num_kv_heads * head_size * elem
        if spec.quant == "per_token_head":
            per_layer += 2 * block_size * num_kv_heads * 4
        return num_layers * per_layer

    @property
    def allocated(self) -> bool:
        return bool(self.layers)

    def allocate(self, k_scales: list[float], v_scales: list[float]) -> None:
        """New zeroed tensors (new addresses) and per-tensor scales."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        per_token = self.spec.quant == "per_token_head"

        def scale_cache():
            return torch.zeros(shape[:3], dtype=torch.float32, device=self.device) if per_token else None

        self.layers = [KVLayer(k=torch.zeros(shape, dtype=self.storage, device=self.device),
                               v=torch.zeros(shape, dtype=self.storage, device=self.device),
                               k_scale=scale_cache(), v_scale=scale_cache()) for _ in range(self.num_layers)]
        self.k_scales = torch.tensor(k_scales, dtype=torch.float32, device=self.device)
        self.v_scales = torch.tensor(v_scales, dtype=torch.float32, device=self.device)

    def build_tables(self) -> None:
        """(Re)build the per-layer views and the pointer/stride tables from the allocation."""

        def view(t):
            return None if t is None else t.view(t.shape)

        self.views = [KVLayer(view(l.k), view(l.v), view(l.k_scale), view(l.v_scale)) for l in self.layers]
        ptrs = [[0 if t is None else t.data_ptr() for t in (l.k, l.v, l.k_scale, l.v_scale)] for l in self.layers]
        self.ptr_table = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        self.stride_table = torch.tensor([list(l.k.stride()) for l in self.layers], dtype=torch.int64,
                                         device=self.device)

    def release(self, keep_tables: bool = False) -> None:
        """Drop every tensor (``keep_tables``: the views and tables survive - the stale-views fault)."""
        self.layers, self.k_scales, self.v_scales = [], None, None
        if not keep_tables:
            self.views, self.ptr_table, self.stride_table = [], None, None

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor of every layer (K, V, scale caches)."""
        return [t for l in self.layers for t in (l.k, l.v, l.k_scale, l.v_scale) if t is not None]

    def zero(self, block_ids: list[int]) -> None:
        dispatch.zero_blocks(block_ids, self.tensors())

    def copy_block(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> None:
        c = self.layers[layer]
        dispatch.store_kv(k, v, c.k, c.v, meta.slot_mapping, self.kv_dtype, self.k_scales[layer],
                          self.v_scales[layer], c.k_scale, c.v_scale)

    def attend(self, layer: int, q: torch.Tensor, meta: AttnMetadata, scale: float) -> torch.Tensor:
        c = self.views[layer]
        v_scale, v_scale_cache = self.v_scales[layer], c.v_scale
        if self.v_with_k_scales:
            v_scale, v_scale_cache = self.k_scales[layer], c.k_scale
        return dispatch.paged_attention(q, c.k, c.v, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                                        self.kv_dtype, self.k_scales[layer], v_scale, c.k_scale, v_scale_cache,
                                        whole_page_reads=self.whole_page_reads, split_tokens=SPLIT_TOKENS)
