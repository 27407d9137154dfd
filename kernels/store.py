"""Triton quantize-and-store of new tokens' K/V into the paged cache.

Same name, signature and results as :func:`kvdiag.kernels.reference.store_kv` (codes and
scales bit-identical: divisions are IEEE round-to-nearest, int8 rounds half away from
zero, fp8 rounds to nearest even). One program stores ``BLOCK_T`` whole tokens, every
kv head of K and V at once (2.3-4.5x faster than a (token, head) grid: BENCHMARKS.md, the
recorded run). A slot of -1 skips the token. Under
TRITON_INTERPRET, whose float->bf16/fp8 casts truncate, values are first rounded on the
target grid in software, so CI checks the same bits the GPU writes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvdiag.dtypes import BUILTIN_DTYPES
from kvdiag.kernels.launch import Launcher, cdiv, next_pow2, sm_count

QUANT_NONE, QUANT_TENSOR, QUANT_TOKEN_HEAD = 0, 1, 2
_QUANT = {"none": QUANT_NONE, "per_tensor": QUANT_TENSOR, "per_token_head": QUANT_TOKEN_HEAD}


@triton.jit
def round_to_fp8_grid(y, MAN: tl.constexpr, EMIN: tl.constexpr):
    """``y`` rounded to nearest even on the fp8 grid (MAN mantissa bits, smallest normal 2**EMIN).

    Only used under TRITON_INTERPRET, whose float->fp8 cast rounds wrongly; an exactly
    representable value then converts exactly. The GPU uses the hardware conversion."""
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    q = ((e - MAN + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / q + 8388608.0) - 8388608.0) * q
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16_grid(x):
    """float32 ``x`` rounded to nearest even on the bf16 grid (interpreter only, see above)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def div_exact(x, d, r, FAST_DIV: tl.constexpr):
    """IEEE round-to-nearest ``x / d``. ``FAST_DIV`` (opt-in, see :func:`fast_paths`): from ``r = 1 / d``
    with one multiply and two FMAs (Markstein's correction, correctly rounded in theory; not yet
    checked on a GPU) instead of a division per element."""
    if FAST_DIV:
        q = x * r
        y = tl.fma(tl.fma(-q, d, x), r, q)
    else:
        y = tl.math.div_rn(x, d)
    return y


@triton.jit
def quantize_rows(x, scale, QUANT: tl.constexpr, QMAX: tl.constexpr, OUT_TY: tl.constexpr,
                  SW_ROUND: tl.constexpr = False, FAST_DIV: tl.constexpr = False):
    """float32 rows ``x`` [R, D] -> (codes in OUT_TY, float32 per-row scales [R]).

    QUANT_NONE casts; QUANT_TENSOR divides by ``scale`` and saturates; QUANT_TOKEN_HEAD
    computes ``max(absmax / QMAX, 1e-6)`` per row (padding columns must hold 0)."""
    if QUANT == 2:
        row_scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX), 1e-6)
        y = div_exact(x, row_scale[:, None], tl.math.div_rn(1.0, row_scale)[:, None], FAST_DIV)
    else:
        row_scale = tl.max(tl.zeros_like(x), axis=1)
        y = x
        if QUANT == 1:
            y = div_exact(x, scale, tl.math.div_rn(1.0, scale), FAST_DIV)
    if OUT_TY == tl.int8:
        # round half away from zero, exactly: truncate y + copysign(0.5 - 2**-25, y) (C's roundf; checked
        # against the reference's formula: tests/unit/test_store_rounding.py)
        half = ((y.to(tl.uint32, bitcast=True) & 0x80000000) | 0x3EFFFFFF).to(tl.float32, bitcast=True)
        codes = tl.minimum(tl.maximum((y + half).to(tl.int32), -128), 127).to(tl.int8)
    elif QUANT == 0:
        codes = y.to(OUT_TY)
    else:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if SW_ROUND:
            y = round_to_fp8_grid(y, OUT_TY.fp_mantissa_width, 1 - OUT_TY.exponent_bias)
        codes = y.to(OUT_TY, fp_downcast_rounding="rtne")
    return codes, row_scale


@triton.jit
def store_rows(src, s_t, s_h, dst, scale_dst, tok, head, d, blk, off, row_ok, c_b, c_o, c_h, sc_b, sc_o, sc_h,
               scale, QUANT: tl.constexpr, QMAX: tl.constexpr, D: tl.constexpr, SW_ROUND: tl.constexpr,
               FAST_DIV: tl.constexpr = False, HINTS: tl.constexpr = False):
    """``HINTS``: stream the data (evict-first loads, ``.cs`` stores): read once, written once."""
    m = row_ok[:, None] & (d[None, :] < D)
    src_ptr = src + tok[:, None] * s_t + head[:, None] * s_h + d[None, :]
    if HINTS:
        x = tl.load(src_ptr, mask=m, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(src_ptr, mask=m, other=0.0)
    if QUANT == 0:
        if SW_ROUND and dst.dtype.element_ty == tl.bfloat16:
            x = round_to_bf16_grid(x.to(tl.float32))
        codes = x.to(dst.dtype.element_ty)
    else:
        codes, row_scale = quantize_rows(x.to(tl.float32), scale, QUANT, QMAX, dst.dtype.element_ty, SW_ROUND,
                                           FAST_DIV)
        if QUANT == 2:
            tl.store(scale_dst + blk * sc_b + off * sc_o + head * sc_h, row_scale, mask=row_ok)
    dst_ptr = dst + (blk * c_b + off * c_o + head * c_h)[:, None] + d[None, :]
    if HINTS:
        tl.store(dst_ptr, codes, mask=m, cache_modifier=".cs")
    else:
        tl.store(dst_ptr, codes, mask=m)


@triton.jit
def load_scale(scale, IS_PTR: tl.constexpr):
    """A per-tensor scale passed as a 0-d tensor (loaded) or a float."""
    if IS_PTR:
        s = tl.load(scale)
    else:
        s = scale
    return s


@triton.jit
def _store_kernel(key, value, k_cache, v_cache, slots, k_scale, v_scale, k_scale_cache, v_scale_cache,
                  num_tokens, s_kt, s_kh, s_vt, s_vh, c_b, c_o, c_h, sc_b, sc_o, sc_h, block_size,
                  NUM_HEADS: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_T: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, K_PTR: tl.constexpr,
                  V_PTR: tl.constexpr,
                  SW_ROUND: tl.constexpr, FAST_DIV: tl.constexpr, HINTS: tl.constexpr, STAGES: tl.constexpr):
    """Program p stores tiles p, p + programs, ... of BLOCK_T tokens (one tile each unless the grid is
    smaller than the tile count: a persistent launch, whose loads ``STAGES`` > 1 may prefetch)."""
    rows = tl.arange(0, BLOCK_T * H_PAD)
    head = rows % H_PAD
    d = tl.arange(0, D_PAD)
    ks = load_scale(k_scale, K_PTR)
    vs = load_scale(v_scale, V_PTR)
    for tile in tl.range(tl.program_id(0), tl.cdiv(num_tokens, BLOCK_T), tl.num_programs(0), num_stages=STAGES):
        tok = (rows // H_PAD).to(tl.int64) + tile * BLOCK_T
        slot = tl.load(slots + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
        row_ok = (slot >= 0) & (head < NUM_HEADS)
        blk, off = slot // block_size, slot % block_size
        store_rows(key, s_kt, s_kh, k_cache, k_scale_cache, tok, head, d, blk, off, row_ok, c_b, c_o, c_h,
                   sc_b, sc_o, sc_h, ks, QUANT, QMAX, D, SW_ROUND, FAST_DIV, HINTS)
        store_rows(value, s_vt, s_vh, v_cache, v_scale_cache, tok, head, d, blk, off, row_ok, c_b, c_o, c_h,
                   sc_b, sc_o, sc_h, vs, QUANT, QMAX, D, SW_ROUND, FAST_DIV, HINTS)


_STORE = Launcher(_store_kernel)


def interpreted() -> bool:
    """True when these kernels were defined under TRITON_INTERPRET (they then take exact software paths)."""
    return not isinstance(_store_kernel, triton.runtime.JITFunction)


def fast_paths() -> bool:
    """The faster arithmetic of compiled kernels (default; ``KVDIAG_TRITON_FAST=0`` turns it off): FMA
    division in the store (bit-identical to IEEE division: BENCHMARKS.md, round 1, and the stores' GPU
    tests), register conversions of 1-byte caches and fp16 dots for fp8 caches in
    attention. The GPU tests run both settings."""
    return os.environ.get("KVDIAG_TRITON_FAST", "1") != "0" and not interpreted()


def quant_params(kv_dtype: str) -> tuple[int, float]:
    """(QUANT constant, qmax) of a registry dtype."""
    d = BUILTIN_DTYPES.get(kv_dtype)
    if d is None:
        raise ValueError(f"unknown kv dtype {kv_dtype!r}; valid: {', '.join(BUILTIN_DTYPES)}")
    return _QUANT[d.quant], float(d.qmax or 1.0)


def scale_arg(scale):
    """A per-tensor scale as a kernel argument: a 0-d tensor stays on the device (no sync)."""
    if isinstance(scale, torch.Tensor):
        return scale, True
    return float(scale), False


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_dtype: str, k_scale=1.0, v_scale=1.0,
             k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None,
             block_t: int | None = None, num_warps: int | None = None, programs: int | None = None,
             hints: bool = False, stages: int | None = None) -> None:
    """See :func:`kvdiag.kernels.reference.store_kv` (``block_t``, ``num_warps``, ``programs`` (a persistent
    grid of that many programs), ``hints`` (streaming cache hints), ``stages`` (its prefetch depth): tuning
    overrides)."""
    quant, qmax = quant_params(kv_dtype)
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride()
    per_token = quant == QUANT_TOKEN_HEAD
    if per_token:
        assert k_scale_cache.stride() == v_scale_cache.stride()
    else:
        k_scale_cache = v_scale_cache = k_cache  # unused placeholders
    (ks, k_ptr), (vs, v_ptr) = scale_arg(k_scale), scale_arg(v_scale)
    if quant != QUANT_TENSOR:
        (ks, k_ptr), (vs, v_ptr) = (1.0, False), (1.0, False)
    h_pad, d_pad = next_pow2(num_heads), next_pow2(head_size)
    block_t = block_t or max(1, (2048 if k_cache.element_size() == 1 else 1024) // (h_pad * d_pad))
    sc = k_scale_cache.stride()[:3] if per_token else (0, 0, 0)
    tiles = cdiv(num_tokens, block_t)
    if per_token:  # absmax before any store: a persistent grid that prefetches the next tile (BENCHMARKS.md, round 1)
        programs = programs or 32 * sm_count(key.device)
        stages, num_warps = stages or 2, num_warps or 4
    _STORE((min(tiles, programs or tiles),),
           (key, value, k_cache, v_cache, slot_mapping, ks, vs, k_scale_cache, v_scale_cache, num_tokens,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), *k_cache.stride()[:3], *sc,
            k_cache.shape[1]),
           dict(NUM_HEADS=num_heads, D=head_size, H_PAD=h_pad, D_PAD=d_pad, BLOCK_T=block_t, QUANT=quant, QMAX=qmax,
                K_PTR=k_ptr, V_PTR=v_ptr, SW_ROUND=interpreted(), FAST_DIV=fast_paths(),
                HINTS=bool(hints) and not interpreted(), STAGES=stages or 1),
           num_warps=num_warps or 2)
