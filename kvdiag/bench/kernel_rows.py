"""Kernel rows of `kvdiag bench`: store, decode and prefill attention, zeroing; each against its baselines.

Baselines, measured in the same run: the torch reference (``reference``); for stores a
(token, head)-grid Triton store like vLLM's per-token-head design (``token_head_grid``);
for attention ``torch.nn.functional.scaled_dot_product_attention`` over a gathered,
dequantized copy of the cache (``sdpa``: gather + dequantize + SDPA; ``extra.sdpa_only_ms``
is SDPA alone over a copy made beforehand).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdiag.bench.measure import gather_dequant, kv_bytes, paged_batch, random_codes, row, sdpa_over_gather, time_ms
from kvdiag.dtypes import BUILTIN_DTYPES
from kvdiag.kernels import attention, reference, store, zero

STORE_DTYPES = list(BUILTIN_DTYPES)
ATTN_DTYPES = ["bfloat16", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"]
MODEL_DTYPE = torch.bfloat16


@triton.jit
def _store_token_head_kernel(key, value, k_cache, v_cache, slots, k_scale_cache, v_scale_cache, s_kt, s_kh, s_vt,
                             s_vh, c_b, c_o, c_h, sc_b, sc_o, sc_h, block_size, D: tl.constexpr,
                             D_PAD: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """The baseline store: one program per (token, kv head)."""
    tok = tl.program_id(0) + tl.zeros([1], tl.int64)
    head = tl.program_id(1) + tl.zeros([1], tl.int32)
    d = tl.arange(0, D_PAD)
    slot = tl.load(slots + tok)
    ok = slot >= 0
    blk, off = slot // block_size, slot % block_size
    store.store_rows(key, s_kt, s_kh, k_cache, k_scale_cache, tok, head, d, blk, off, ok, c_b, c_o, c_h,
                     sc_b, sc_o, sc_h, 1.0, QUANT, QMAX, D, False)
    store.store_rows(value, s_vt, s_vh, v_cache, v_scale_cache, tok, head, d, blk, off, ok, c_b, c_o, c_h,
                     sc_b, sc_o, sc_h, 1.0, QUANT, QMAX, D, False)


def store_token_head_grid(key, value, k_cache, v_cache, slots, kv_dtype, ksc=None, vsc=None):
    quant, qmax = store.quant_params(kv_dtype)
    t, h, d = key.shape
    ksc, vsc = (ksc, vsc) if ksc is not None else (k_cache, v_cache)
    sc = ksc.stride()[:3] if ksc.dim() == 3 else (0, 0, 0)
    _store_token_head_kernel[(t, h)](key, value, k_cache, v_cache, slots, ksc, vsc, *key.stride()[:2],
                                     *value.stride()[:2], *k_cache.stride()[:3], *sc, k_cache.shape[1], D=d,
                                     D_PAD=triton.next_power_of_2(d), QUANT=quant, QMAX=qmax, num_warps=4)


def bench_store(kv_dtype, tokens, kv_heads, head_size, block_size, device, copy):
    key, value = (torch.randn(tokens, kv_heads, head_size, device=device).to(MODEL_DTYPE) for _ in range(2))
    nb = tokens // block_size + 16
    shape = (nb, block_size, kv_heads, head_size)
    kc, vc = (random_codes(shape, kv_dtype, MODEL_DTYPE, device) for _ in range(2))
    per_token = BUILTIN_DTYPES[kv_dtype].quant == "per_token_head"
    ksc, vsc = (torch.rand(shape[:3], device=device) for _ in range(2)) if per_token else (None, None)
    slots = torch.randperm(nb * block_size, device=device)[:tokens]
    ks = torch.tensor(0.8, device=device)
    args = (key, value, kc, vc, slots, kv_dtype, ks, ks, ksc, vsc)
    fns = {"triton": lambda: store.store_kv(*args), "reference": lambda: reference.store_kv(*args),
           "token_head_grid": lambda: store_token_head_grid(key, value, kc, vc, slots, kv_dtype, ksc, vsc)}
    n = tokens * kv_heads * head_size
    nbytes = 2 * n * (key.element_size() + kc.element_size()) + 8 * tokens + (8 * tokens * kv_heads if per_token else 0)
    return row("store", kv_dtype, f"{tokens // 1024}k tok x {kv_heads}x{head_size} bs{block_size}", fns, nbytes,
               copy)


def bench_attention(kind, kv_dtype, seqs, q_len, ctx, heads, kv_heads, head_size, block_size, device, copy):
    b = paged_batch(kv_dtype, [q_len] * seqs, [ctx] * seqs, heads, kv_heads, head_size, block_size, MODEL_DTYPE,
                    device)
    ours = attention.paged_attention(*b.args())
    want = sdpa_over_gather(b, q_len, ctx, torch.float32, gather_dequant(b, ctx, torch.float32))
    err = float((ours.float() - want.float()).norm() / want.float().norm())
    dense = gather_dequant(b, ctx, MODEL_DTYPE)
    sdpa_only = time_ms(lambda: sdpa_over_gather(b, q_len, ctx, MODEL_DTYPE, dense))  # noqa: F821
    del dense, want
    fns = {"triton": lambda: attention.paged_attention(*b.args()),
           "reference": lambda: reference.paged_attention(*b.args()),
           "sdpa": lambda: sdpa_over_gather(b, q_len, ctx, MODEL_DTYPE)}
    nbytes = kv_bytes(b) + (0 if q_len == 1 else 2 * b.query.numel() * b.query.element_size())
    r = row(kind, kv_dtype, f"{seqs} seq x {ctx} ctx, q {q_len}, {heads}/{kv_heads}x{head_size} bs{block_size}",
            fns, nbytes, copy, {"rel_err_vs_fp32_sdpa": err, "sdpa_only_ms": sdpa_only})
    r.extra["speedup_vs_sdpa_only"] = sdpa_only / r.ms
    if q_len > 1:
        r.extra["tflops"] = 4 * seqs * heads * head_size * q_len * (ctx - q_len / 2) / r.ms / 1e9
    return r


def bench_zero(kv_dtype, blocks, layers, num_blocks, kv_heads, head_size, block_size, device, copy):
    shape = (num_blocks, block_size, kv_heads, head_size)
    tensors = []
    for _ in range(layers):
        tensors += [random_codes(shape, kv_dtype, MODEL_DTYPE, device) for _ in range(2)]
        if BUILTIN_DTYPES[kv_dtype].quant == "per_token_head":
            tensors += [torch.rand(shape[:3], device=device) for _ in range(2)]
    ids = torch.randperm(num_blocks)[:blocks].tolist()
    fns = {"triton": lambda: zero.zero_blocks(ids, tensors), "reference": lambda: reference.zero_blocks(ids, tensors)}
    nbytes = blocks * sum(t.stride(0) * t.element_size() for t in tensors)
    return row("zero", kv_dtype, f"{blocks} blocks x {len(tensors)} tensors ({layers} layers)", fns, nbytes, copy,
               {"launches": 1})


# the sizes of a run: "full" (the targets), "quick" (a smoke run on a GPU), "tiny" (CPU tests)
SHAPES = {
    "full": dict(tokens=256 * 1024, heads=32, kv_heads=8, head_size=128, seqs=32, ctx=4096, prefill_seqs=8,
                 layers=24, zero_blocks=1000, num_blocks=2048, block_sizes=(16, 32)),
    "quick": dict(tokens=16 * 1024, heads=32, kv_heads=8, head_size=128, seqs=32, ctx=512, prefill_seqs=8,
                  layers=4, zero_blocks=1000, num_blocks=2048, block_sizes=(16, 32)),
    "tiny": dict(tokens=8, heads=4, kv_heads=2, head_size=16, seqs=2, ctx=32, prefill_seqs=2, layers=2,
                 zero_blocks=4, num_blocks=16, block_sizes=(16,)),
}


def kernel_rows(kinds, device, copy, size: str = "full"):
    """Every kernel row of the report, in order, as callables the caller runs one by one."""
    z = SHAPES[size]
    heads, kvh, hd, bs = z["heads"], z["kv_heads"], z["head_size"], z["block_sizes"][0]
    for d in STORE_DTYPES if "store" in kinds else ():
        yield lambda d=d: bench_store(d, z["tokens"], kvh, hd, bs, device, copy)
    for d in ATTN_DTYPES if "decode" in kinds else ():
        yield lambda d=d: bench_attention("decode", d, z["seqs"], 1, z["ctx"], heads, kvh, hd, bs, device, copy)
    for page in z["block_sizes"][1:]:
        for d in ("bfloat16", "int8_per_token_head") if "decode" in kinds else ():
            yield lambda d=d, p=page: bench_attention("decode", d, z["seqs"], 1, z["ctx"], heads, kvh, hd, p, device,
                                                      copy)
    half = z["ctx"] // 2
    for d in ("bfloat16", "fp8", "int8_per_token_head") if "prefill" in kinds else ():
        yield lambda d=d: bench_attention("prefill", d, z["prefill_seqs"], half, half, heads, kvh, hd, bs, device,
                                          copy)
    for d in ("bfloat16", "int8_per_token_head") if "zero" in kinds else ():
        yield lambda d=d: bench_zero(d, z["zero_blocks"], z["layers"], z["num_blocks"], kvh, hd, bs, device, copy)
