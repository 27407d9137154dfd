"""kvdiag's views of vLLM's KV cache layouts, on fake attention layers (no vLLM needed): vLLM 0.24's CUDA
backends keep a layer's cache as [num_blocks, 2, block_size, heads, content] in any stride order (HND or NHD),
with the per-token-head dtypes' float32 scale inline after each head."""

from types import SimpleNamespace

import pytest
import torch

from kvdiag.engines.vllm.kv import layer_view

NB, BS, H, HS = 5, 16, 2, 8


def layer(raw, backend="FLASH_ATTN", kv_cache_dtype="auto", impl=None):
    return SimpleNamespace(kv_cache=[raw], head_size=HS, kv_cache_dtype=kv_cache_dtype, impl=impl or SimpleNamespace(),
                           attn_backend=SimpleNamespace(get_name=lambda: backend))


@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4)])  # NHD, HND (vLLM's stride orders)
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"])
def test_cuda_layout_in_any_stride_order_gives_kvdiags_layout(order, backend):
    logical = (NB, 2, BS, H, HS)
    physical = torch.randn([logical[i] for i in order], dtype=torch.bfloat16)
    raw = physical.permute(*[order.index(i) for i in range(5)])  # vLLM: a permuted view with the logical shape
    assert raw.shape == logical
    view = layer_view(layer(raw, backend), NB, torch.bfloat16)
    assert view.k.shape == view.v.shape == (NB, BS, H, HS) and view.k_scale is None
    assert torch.equal(view.k, raw[:, 0]) and torch.equal(view.v, raw[:, 1])
    view.k[3, 5, 1].fill_(7)  # a view, not a copy: what kvdiag writes (poison) lands in the cache
    assert (raw[3, 0, 5, 1] == 7).all() and (physical == 7).sum() == HS


def test_per_token_head_scales_come_from_the_backends_scale_views():
    raw = torch.zeros(NB, 2, BS, H, HS + 4, dtype=torch.int8)  # + 4 int8 slots: one float32 scale per head
    scales = SimpleNamespace(_k_scale_cache=None, _v_scale_cache=None)

    def ensure(kv_cache):
        scales._k_scale_cache = torch.ones(NB, BS, H)
        scales._v_scale_cache = torch.full((NB, BS, H), 2.0)

    scales._ensure_scale_caches = ensure
    view = layer_view(layer(raw, "TRITON_ATTN", "int8_per_token_head", scales), NB, torch.bfloat16)
    assert view.k.shape == (NB, BS, H, HS) and view.k.dtype == torch.int8
    assert view.k_scale is scales._k_scale_cache and float(view.v_scale[0, 0, 0]) == 2.0


def test_poison_writes_reach_inference_tensors():
    """vLLM makes its per-token-head scale caches inside torch.inference_mode(): writes from outside it must not
    raise (they did on the H100: 'Inplace update to inference tensor outside InferenceMode is not allowed')."""
    from kvdiag.checks.kv_tensors import fill_blocks
    from kvdiag.engines.base import KVBlockView, KVLayer

    with torch.inference_mode():
        k, v = torch.zeros(NB, BS, H, HS, dtype=torch.int8), torch.zeros(NB, BS, H, HS, dtype=torch.int8)
        ks, vs = torch.ones(NB, BS, H), torch.ones(NB, BS, H)
    view = KVBlockView(BS, NB, [KVLayer(k, v, ks, vs)], lambda: [1, 3], lambda: [])
    fill_blocks(view, [1, 3], "nan")
    assert torch.isnan(ks[1]).all() and torch.isnan(vs[3]).all() and not torch.isnan(ks[0]).any()
