"""kvdiag.kernels.reference (via dispatch): quantization formulas, store, zero, paged attention."""

import math
import os

import pytest
import torch

from kvdiag.dtypes import BUILTIN_DTYPES
from kvdiag.kernels import dispatch, reference

DEV = torch.device(os.environ.get("KVDIAG_TEST_DEVICE", "cpu"))


def _heads(seed=0, n=37, kvh=3, hd=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, kvh, hd, generator=g) * torch.rand(n, kvh, 1, generator=g) * 4
    x[3, 1] = 0.0  # an all-zero head: the 1e-6 floor
    # exact .5 ties: absmax 63.5 -> scale 0.5 exactly; x/scale = 2.5, -2.5, 0.5, -126.5
    x[5, 0] = 0.0
    x[5, 0, :6] = torch.tensor([63.5, 1.25, -1.25, 0.25, -63.25, 0.75])
    return x.to(DEV)


def _scale_formula(x, qmax):
    """float32 max(absmax/qmax, 1e-6), the division done in float64 and rounded once (= IEEE float32 division)."""
    return torch.clamp((x.double().abs().amax(-1) / qmax).float(), min=1e-6)


def _divide(x, scales):
    """float32 x / scale per (token, head), exactly rounded (float64 then float32)."""
    return (x.double() / scales.double()[..., None]).float()


def test_int8_per_token_head_matches_vllm_formula():
    x = _heads()
    codes, scales = reference.quantize_per_token_head(x, "int8_per_token_head")
    want_scale = _scale_formula(x, 127.0)
    assert scales.dtype == torch.float32 and torch.equal(scales, want_scale)
    assert scales[3, 1].item() == pytest.approx(1e-6) and scales[5, 0].item() == 0.5
    y = _divide(x, want_scale).double()  # rounding to integers in float64
    want = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-128, 127).to(torch.int8)
    assert codes.dtype == torch.int8 and torch.equal(codes, want)
    assert codes[5, 0, :6].tolist() == [127, 3, -3, 1, -127, 2]  # half away from zero, not to even
    assert torch.equal(codes[3, 1], torch.zeros_like(codes[3, 1]))


def test_fp8_per_token_head_matches_vllm_formula():
    x = _heads(seed=1)
    codes, scales = reference.quantize_per_token_head(x, "fp8_per_token_head")
    want_scale = _scale_formula(x, 448.0)
    assert torch.equal(scales, want_scale)
    want = _divide(x, want_scale).to(torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))


def test_int8_dequantized_error_is_at_most_half_a_step():
    x = _heads(seed=2)
    codes, scales = reference.quantize_per_token_head(x, "int8_per_token_head")
    back = reference.dequantize(codes, "int8_per_token_head", scales=scales)
    err = (back - x.float()).abs()
    assert (err <= scales[..., None] / 2 * (1 + 1e-5) + 1e-12).all()


@pytest.mark.parametrize("name,qmax", [("fp8", 448.0), ("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_per_tensor_saturates(name, qmax):
    x = torch.tensor([1e9, -1e9, 3 * qmax, -2 * qmax, 1.0, 0.0], device=DEV)
    codes = reference.quantize_per_tensor(x, name, torch.tensor(2.0, device=DEV))
    back = codes.float().tolist()
    assert back[:4] == [qmax, -qmax, qmax, -qmax] and back[4:] == [0.5, 0.0]
    assert reference.dequantize(codes, name, 2.0).tolist()[:2] == [2 * qmax, -2 * qmax]


@pytest.mark.parametrize("kv_dtype", list(BUILTIN_DTYPES))
def test_store_kv_writes_listed_slots_and_skips_minus_one(kv_dtype):
    d = BUILTIN_DTYPES[kv_dtype]
    storage = d.torch_dtype(torch.float32)
    nb, bs, kvh, hd = 6, 4, 2, 16
    k_cache = torch.zeros(nb, bs, kvh, hd, dtype=storage, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    per_token = d.quant == "per_token_head"
    ksc = torch.full((nb, bs, kvh), -7.0, device=DEV) if per_token else None
    vsc = torch.full((nb, bs, kvh), -7.0, device=DEV) if per_token else None
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(5, kvh, hd, generator=g).to(DEV), torch.randn(5, kvh, hd, generator=g).to(DEV)
    slots = torch.tensor([9, -1, 0, 23, -1], device=DEV)
    k_scale = torch.tensor(0.5, device=DEV)
    dispatch.store_kv(key, value, k_cache, v_cache, slots, kv_dtype, k_scale, 1.0, ksc, vsc)
    written = [9, 0, 23]
    flat_k, flat_v = k_cache.flatten(0, 1).float(), v_cache.flatten(0, 1).float()
    untouched = [s for s in range(nb * bs) if s not in written]
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()
    src = [0, 2, 3]
    for cache, x, sc, ts in ((k_cache, key, ksc, k_scale), (v_cache, value, vsc, 1.0)):
        rows = cache.flatten(0, 1)[written]
        if d.quant == "none":
            want, scales = x[src].to(storage), None
        elif d.quant == "per_tensor":
            want, scales = reference.quantize_per_tensor(x[src], kv_dtype, ts), None
        else:
            want, scales = reference.quantize_per_token_head(x[src], kv_dtype)
            assert torch.equal(sc.flatten(0, 1)[written], scales)
            assert (sc.flatten(0, 1)[untouched] == -7).all()
        assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))
        back = reference.dequantize(rows, kv_dtype, ts, scales)
        tol = {"none": 1e-2, "per_tensor": 0.13, "per_token_head": 0.07}[d.quant]
        assert torch.allclose(back, x[src].float(), atol=tol * (4 if kv_dtype == "fp8_e5m2" else 1), rtol=0.07)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_zero_blocks_zeroes_exactly_the_listed_blocks(dtype):
    ts = [(torch.randn(5, 4, 2, 8, device=DEV) + 3).to(dtype), torch.randn(5, 4, 2, device=DEV) + 3]
    before = [t.clone() for t in ts]
    dispatch.zero_blocks([1, 3], ts + [None])
    for t, b in zip(ts, before):
        assert (t[[1, 3]].float() == 0).all()
        assert torch.equal(t[[0, 2, 4]].float(), b[[0, 2, 4]].float())


def _paged_setup(kv_dtype, q_lens, seq_lens, seed=0, nb=24, bs=4, kvh=2, heads=6, hd=16):
    """Random caches and shuffled block tables; returns the kernel args and the dequantized dense K/V."""
    g = torch.Generator().manual_seed(seed)
    d = BUILTIN_DTYPES[kv_dtype]
    storage = d.torch_dtype(torch.float32)
    k_cache = torch.zeros(nb, bs, kvh, hd, dtype=storage, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    per_token = d.quant == "per_token_head"
    ksc = torch.zeros(nb, bs, kvh, device=DEV) if per_token else None
    vsc = torch.zeros(nb, bs, kvh, device=DEV) if per_token else None
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(-(-n // bs) for n in seq_lens)
    tables, dense = [], []
    for n in seq_lens:
        ids = [perm.pop() for _ in range(-(-n // bs))]
        tables.append(ids + [0] * (width - len(ids)))
        k, v = torch.randn(n, kvh, hd, generator=g).to(DEV), torch.randn(n, kvh, hd, generator=g).to(DEV)
        slots = torch.tensor([ids[p // bs] * bs + p % bs for p in range(n)], device=DEV)
        dispatch.store_kv(k, v, k_cache, v_cache, slots, kv_dtype, 1.0, 1.0, ksc, vsc)
        flat = [c.flatten(0, 1)[slots] for c in (k_cache, v_cache)]
        scl = [None if s is None else s.flatten(0, 1)[slots] for s in (ksc, vsc)]
        dense.append([reference.dequantize(c, kv_dtype, 1.0, s).double() for c, s in zip(flat, scl)])
    q = torch.randn(sum(q_lens), heads, hd, generator=g).to(DEV)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    args = (q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
            torch.tensor(tables, dtype=torch.int32, device=DEV), hd ** -0.5, kv_dtype, 1.0, 1.0, ksc, vsc)
    return args, dense


def _dense_attention(q, dense, q_lens, seq_lens, scale):
    outs, start = [], 0
    for (k, v), ql, n in zip(dense, q_lens, seq_lens):
        qs = q[start:start + ql].double()
        start += ql
        group = qs.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, kk) * scale
        qpos = torch.arange(n - ql, n, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > qpos, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8_per_token_head", "fp8", "fp8_per_token_head"])
def test_paged_attention_matches_dense_causal_attention(kv_dtype):
    q_lens, seq_lens = [7, 1, 1, 5, 13], [7, 9, 16, 22, 13]  # prefill, decodes, prefill over a cached prefix
    args, dense = _paged_setup(kv_dtype, q_lens, seq_lens)
    out = dispatch.paged_attention(*args)
    want = _dense_attention(args[0], dense, q_lens, seq_lens, args[6])
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert torch.allclose(out.double(), want, atol=1e-5)


def test_paged_attention_never_reads_past_seq_len_unless_whole_page_reads():
    q_lens, seq_lens = [3, 1], [6, 10]
    args, dense = _paged_setup("auto", q_lens, seq_lens)
    k_cache, v_cache, tables = args[1], args[2], args[5]
    used = {(b, o) for s, n in enumerate(seq_lens) for p in range(n)
            for b, o in [(int(tables[s, p // 4]), p % 4)]}
    for b in range(k_cache.shape[0]):  # NaN everywhere no sequence wrote, including its last block's tail
        for o in range(4):
            if (b, o) not in used:
                k_cache[b, o], v_cache[b, o] = math.nan, math.nan
    out = dispatch.paged_attention(*args)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), _dense_attention(args[0], dense, q_lens, seq_lens, args[6]), atol=1e-5)
    bad = dispatch.paged_attention(*args, whole_page_reads=True)
    assert torch.isnan(bad).any()


def test_kernels_env_forces_reference(monkeypatch):
    monkeypatch.setenv("KVDIAG_KERNELS", "reference")
    assert dispatch.backend("paged_attention", torch.device("cuda")) == "reference"
    assert dispatch.backend("paged_attention", torch.device("cpu")) == "reference"
    monkeypatch.delenv("KVDIAG_KERNELS")
    assert dispatch.backend("paged_attention", torch.device("cpu")) == "cpu"  # kernels/cpu_attention.py
    assert dispatch.backend("store_kv", torch.device("cpu")) == "reference"
