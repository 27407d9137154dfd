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
    raise (torch's 'Inplace update to inference tensor outside InferenceMode is not allowed')."""
    from kvdiag.checks.kv_tensors import fill_blocks
    from kvdiag.engines.base import KVBlockView, KVLayer

    with torch.inference_mode():
        k, v = torch.zeros(NB, BS, H, HS, dtype=torch.int8), torch.zeros(NB, BS, H, HS, dtype=torch.int8)
        ks, vs = torch.ones(NB, BS, H), torch.ones(NB, BS, H)
    view = KVBlockView(BS, NB, [KVLayer(k, v, ks, vs)], lambda: [1, 3], lambda: [])
    fill_blocks(view, [1, 3], "nan")
    assert torch.isnan(ks[1]).all() and torch.isnan(vs[3]).all() and not torch.isnan(ks[0]).any()


def mla_layer(raw, kv_cache_dtype="auto", rank=16, rope=4):
    return SimpleNamespace(kv_cache=raw, head_size=rank + rope, kv_lora_rank=rank, kv_cache_dtype=kv_cache_dtype,
                           impl=SimpleNamespace(), attn_backend=SimpleNamespace(get_name=lambda: "FLASHMLA"))


@pytest.mark.parametrize("kv_dtype,raw_dtype", [("auto", torch.bfloat16), ("fp8", torch.uint8)])
def test_an_mla_cache_is_one_head_latent_then_rope_and_poison_lands_in_both(kv_dtype, raw_dtype):
    """vLLM's MLA backends: one row of kv_lora_rank + rope elements per token (fp8 kept as uint8). kvdiag views the
    latent as k and the rope part as v, one head, and a poison fill of a block reaches every byte of its rows."""
    from kvdiag.checks.kv_tensors import block_slots, fill_blocks, scan_slots
    from kvdiag.engines.base import KVBlockView

    raw = torch.zeros(NB, BS, 20, dtype=raw_dtype)
    lay = layer_view(mla_layer(raw, kv_dtype), NB, torch.bfloat16)
    assert lay.k.shape == (NB, BS, 1, 16) and lay.v.shape == (NB, BS, 1, 4)
    assert lay.k.dtype == (torch.bfloat16 if kv_dtype == "auto" else torch.float8_e4m3fn)
    view = KVBlockView(BS, NB, [lay], lambda: [2], lambda: [])
    fill_blocks(view, [2], "nan")
    bits = raw.view(torch.uint8).view(NB, BS, -1)
    assert (bits[2] != 0).all() and (bits[[0, 1, 3, 4]] == 0).all()  # every byte of block 2's rows, no other
    scan = scan_slots(view, block_slots([1, 2], BS))
    assert scan.nonfinite == BS and scan.first["block"] == 2


def test_fp8_ds_mla_packed_rows_are_refused_with_the_reason():
    from kvdiag.engines.vllm.cpu_layout import KVAccessError

    raw = torch.zeros(NB, BS, 656, dtype=torch.uint8)  # 512 fp8 + 4 float32 scales + 64 bf16: 656 bytes a token
    with pytest.raises(KVAccessError, match="656 elements a token, not latent 512 \\+ rope 64"):
        layer_view(mla_layer(raw, "fp8_ds_mla", 512, 64), NB, torch.bfloat16)
