"""Triton paged attention over the (quantized) cache, dequantization fused in.

Same name, signature and semantics as :func:`kvdiag.kernels.reference.paged_attention`.
One kernel, two launch shapes:

- decode (``num_tokens <= num_seqs``): one program per (kv head, query token, KV split);
  its rows are the token's query heads of that kv head (GQA), padded to 16. Long
  contexts are cut into splits whose partial results a second kernel combines (one program per
  token and kv head).
- prefill: one program per (kv head, tile of ``BLOCK_Q`` query tokens of one sequence),
  rows = tokens x heads; a program finds its sequence by binary search over
  ``query_start_loc`` (vLLM's ``q_start // BLOCK_Q + s`` numbering), so no host sync.

K codes enter the dot product in the query's dtype where exact (int8, fp8, same dtype),
else float32 (IEEE); per-token-head K scales multiply the score columns, per-tensor
``k_scale`` folds into the softmax scale; V's per-token-head scales multiply the
probabilities before the P.V product, per-tensor ``v_scale`` the result. Decode over 1-byte
caches (with the fast paths) converts the K codes in the dot operand's layout (``PURE_K``,
BENCHMARKS.md "Round 3").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdiag.kernels.launch import Launcher, cdiv, next_pow2, sm_count
from kvdiag.kernels.store import (
    QUANT_TENSOR,
    QUANT_TOKEN_HEAD,
    fast_paths,
    interpreted,
    load_scale,
    quant_params,
    scale_arg,
)

LOG2E = tl.constexpr(1.4426950408889634)
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so fully masked tiles give 0 weights, not NaN
BLOCK_M_PREFILL = 64
MIN_SPLIT_TOKENS = 512
S_CHUNK = 16  # splits the combine kernel merges at once
WAVE_FILL = 0.95  # default_splits: one split where one program per row fills its waves to this fraction


@triton.jit
def find_seq(qsl, num_seqs, target, BQ: tl.constexpr, ADD_S: tl.constexpr):
    """Largest s < num_seqs with ``qsl[s] // BQ + s * ADD_S <= target`` (guess s = target first)."""
    g = tl.minimum(target, num_seqs - 1)
    hit = (tl.load(qsl + g) // BQ + g * ADD_S <= target) & (target < tl.load(qsl + g + 1) // BQ + (g + 1) * ADD_S)
    lo = tl.where(hit, g, 0)
    hi = tl.where(hit, g + 1, num_seqs)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = tl.load(qsl + mid) // BQ + mid * ADD_S <= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def i8_to_bf16(x, PURE: tl.constexpr):
    """Exact int8 -> bf16 in registers, 4 values per 32-bit word: the bytes biased by 128 become the low
    bits of 2**23 in float32, minus 2**23 + 128, packed to bf16 pairs. Used when compiled: Triton's own
    conversion would move the int8 tile through shared memory one byte at a time. ``PURE``: see
    :func:`to_compute`."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m, a0, a1, a2, a3;
        xor.b32 t, $2, 0x80808080;
        mov.b32 m, 0x4B000000;
        prmt.b32 a0, t, m, 0x7650;
        prmt.b32 a1, t, m, 0x7651;
        prmt.b32 a2, t, m, 0x7652;
        prmt.b32 a3, t, m, 0x7653;
        sub.f32 a0, a0, 0f4B000080;
        sub.f32 a1, a1, 0f4B000080;
        sub.f32 a2, a2, 0f4B000080;
        sub.f32 a3, a3, 0f4B000080;
        cvt.rn.bf16x2.f32 $0, a1, a0;
        cvt.rn.bf16x2.f32 $1, a3, a2;
        }""",
        constraints="=r,=r,r", args=[x], dtype=tl.bfloat16, is_pure=PURE, pack=4)


@triton.jit
def i8_to_f16(x, PURE: tl.constexpr):
    """Exact int8 -> fp16 in registers, 2 values per packed subtraction: the bytes biased by 128 become the
    low mantissa bits of 1024.0 in fp16 (``prmt``), minus 1024 + 128."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .b32 t, m, c; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64646464; mov.b32 c, 0x64806480; "
            "prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; sub.rn.f16x2 $0, $0, c; sub.rn.f16x2 $1, $1, c; }",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=PURE, pack=4)


@triton.jit
def fp8_to_f16(x, E5M2: tl.constexpr, PURE: tl.constexpr):
    """fp8 (e4m3fn or e5m2) -> fp16 in registers, 2 values per instruction (NaN kept)."""
    if E5M2:
        cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2"
    else:
        cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2"
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; " + cvt.value + " $0, lo; " + cvt.value + " $1, hi; }",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=PURE, pack=4)


@triton.jit
def to_compute(x, CDT: tl.constexpr, FAST: tl.constexpr, PURE: tl.constexpr = False):
    """Cache codes -> the dot's dtype. ``FAST`` (compiled only): convert in registers; not ``PURE``: where
    the data was loaded (Triton cannot move the asm past the layout change), the converted tile then goes
    through shared memory to the dot; ``PURE``: Triton hoists the dot operand's layout above the asm and
    reads the codes from shared memory in that layout (decode's K tile: faster, BENCHMARKS.md "Round 3";
    for V, whose dot operand needs consecutive tokens, one byte per load: slower). Without FAST, Triton
    moves 1-byte tiles through shared memory one byte at a time."""
    if FAST == 1:
        y = i8_to_bf16(x, PURE)
    elif FAST == 2:
        y = fp8_to_f16(x, False, PURE)
    elif FAST == 3:
        y = fp8_to_f16(x, True, PURE)
    elif FAST == 4:
        y = i8_to_f16(x, PURE)
    else:
        y = x.to(CDT)
    return y


@triton.jit
def _attn_kernel(q, k_cache, v_cache, k_scale_cache, v_scale_cache, k_scale, v_scale, qsl, seq_lens, block_tables,
                 out, part_o, part_ml, sm_scale, num_seqs, num_tokens, s_qt, s_qh, s_ot, s_oh, c_b, c_o, c_h,
                 sc_b, sc_o, sc_h, bt_s, split_len,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, ADD_S: tl.constexpr, QUANT: tl.constexpr,
                 K_PTR: tl.constexpr, V_PTR: tl.constexpr, WHOLE_PAGE: tl.constexpr, SPLIT: tl.constexpr,
                 CDT: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, PRESCALE: tl.constexpr,
                 PURE_K: tl.constexpr):
    kvh, pid, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = find_seq(qsl, num_seqs, pid, BLOCK_Q, ADD_S)
    q_start, q_end = tl.load(qsl + s), tl.load(qsl + s + 1)
    t0 = q_start + (pid - (q_start // BLOCK_Q + s * ADD_S)) * BLOCK_Q
    if t0 >= q_end:
        return
    ctx = tl.load(seq_lens + s)
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = t0 + rows // G_PAD
    head = kvh * G + rows % G_PAD
    row_ok = (tok < q_end) & (rows % G_PAD < G)
    pos = ctx - q_end + tok
    d = tl.arange(0, D_PAD)
    io_mask = row_ok[:, None] & (d[None, :] < D)
    qt = tl.load(q + tok[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + d[None, :], mask=io_mask, other=0.0)
    if WHOLE_PAGE:
        n_read = tl.cdiv(ctx, PAGE) * PAGE
    else:
        n_read = ctx - q_end + tl.minimum(t0 + BLOCK_Q, q_end)
    lo = sp * split_len
    if SPLIT and lo >= n_read:  # an empty split (splits sized for the longest context): nothing to write
        return
    hi = tl.minimum(lo + split_len, n_read)
    qk_scale = sm_scale * LOG2E
    if QUANT == 1:
        qk_scale = qk_scale * load_scale(k_scale, K_PTR)
    if PRESCALE:  # a bf16 query entering an fp16 dot: scale first, away from fp16's overflow
        qt = (qt.to(tl.float32) * qk_scale).to(CDT)
        qk_scale = 1.0
    else:
        qt = qt.to(CDT)
    m_i = tl.full([BLOCK_Q * G_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        ld = offs < hi
        page = tl.load(block_tables + s * bt_s + offs // PAGE, mask=ld, other=0).to(tl.int64)
        in_page = offs % PAGE
        kv_off = (page * c_b + in_page * c_o + kvh * c_h)[:, None] + d[None, :]
        kv_mask = ld[:, None] & (d[None, :] < D)
        k = to_compute(tl.load(k_cache + kv_off, mask=kv_mask, other=0.0), CDT, FAST, PURE_K)
        scores = tl.dot(qt, tl.trans(k), input_precision=PREC)
        if QUANT == 2:
            sc_off = page * sc_b + in_page * sc_o + kvh * sc_h
            scores = scores * tl.load(k_scale_cache + sc_off, mask=ld, other=0.0)[None, :]
        allowed = (offs[None, :] <= pos[:, None]) & (offs[None, :] < ctx)
        scores = tl.where(allowed, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = to_compute(tl.load(v_cache + kv_off, mask=kv_mask, other=0.0), CDT, FAST)
        if QUANT == 2:
            p = p * tl.load(v_scale_cache + sc_off, mask=ld, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v, input_precision=PREC)
        m_i = m_new
    if QUANT == 1:
        acc = acc * load_scale(v_scale, V_PTR)
    if SPLIT:
        num_splits = tl.num_programs(2)
        part = (tok.to(tl.int64) * tl.num_programs(0) * G + head) * num_splits + sp
        tl.store(part_o + part[:, None] * D_PAD + d[None, :], acc, mask=io_mask)
        tl.store(part_ml + part, m_i, mask=row_ok)
        tl.store(part_ml + num_tokens * tl.num_programs(0) * G * num_splits + part, l_i, mask=row_ok)
    else:
        o = acc / l_i[:, None]
        tl.store(out + tok[:, None].to(tl.int64) * s_ot + head[:, None] * s_oh + d[None, :],
                 o.to(out.dtype.element_ty), mask=io_mask)


@triton.jit
def merge_heads(part_o, part_ml, o_ptr, row0, n_sp, num_splits, num_rows, s_oh, G: tl.constexpr, G4: tl.constexpr,
                D: tl.constexpr, D_PAD: tl.constexpr, S_CHUNK: tl.constexpr):
    """Rows ``row0 .. row0 + G - 1`` (a token's query heads of one kv head) of the partial results: their first
    ``n_sp`` splits merged by running max and sum, in split order, S_CHUNK splits at a time (one round of
    loads where n_sp <= S_CHUNK), written to ``o_ptr`` (head stride ``s_oh``). Loads bypass L1."""
    g = tl.arange(0, G4)
    sp = tl.arange(0, S_CHUNK)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    rows = row0 + g
    m_max = tl.full([G4], NEG_BIG, tl.float32)
    l_sum = tl.zeros([G4], tl.float32)
    acc = tl.zeros([G4, D_PAD], tl.float32)
    for c in range(0, n_sp, S_CHUNK):
        ok = g_ok[:, None] & (c + sp < n_sp)[None, :]
        idx = rows[:, None] * num_splits + c + sp[None, :]
        m = tl.load(part_ml + idx, mask=ok, other=NEG_BIG, cache_modifier=".cg")
        l_ = tl.load(part_ml + num_rows * num_splits + idx, mask=ok, other=0.0, cache_modifier=".cg")
        o = tl.load(part_o + idx[:, :, None] * D_PAD + d[None, None, :], mask=ok[:, :, None], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m_max, tl.max(m, 1))
        alpha = tl.exp2(m_max - m_new)
        w = tl.where(ok, tl.exp2(m - m_new[:, None]), 0.0)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        l_sum = l_sum * alpha + tl.sum(l_ * w, 1)
        m_max = m_new
    tl.store(o_ptr + g[:, None] * s_oh + d[None, :], (acc / l_sum[:, None]).to(o_ptr.dtype.element_ty),
             mask=g_ok[:, None] & (d[None, :] < D))


@triton.jit
def _combine_kernel(part_o, part_ml, out, qsl, seq_lens, s_ot, s_oh, num_splits, num_rows, num_seqs, split_len,
                    G: tl.constexpr, G4: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S_CHUNK: tl.constexpr,
                    PAGE: tl.constexpr, WHOLE_PAGE: tl.constexpr):
    """One program per (token t, kv head): out[t, its query heads] = the token's non-empty splits merged
    (:func:`merge_heads`). Splits past the token's context were never written and are not read, so the
    result does not depend on how many splits the launch had (a CUDA graph sized for the longest context
    gives the bits of an eager launch sized for the batch)."""
    t, kvh = tl.program_id(0), tl.program_id(1)
    s = find_seq(qsl, num_seqs, t, 1, 0)
    q_end, ctx = tl.load(qsl + s + 1), tl.load(seq_lens + s)
    if WHOLE_PAGE:
        n_read = tl.cdiv(ctx, PAGE) * PAGE
    else:
        n_read = ctx - q_end + tl.minimum(t + 1, q_end)
    n_sp = tl.minimum(tl.cdiv(n_read, split_len), num_splits)
    row0 = t.to(tl.int64) * tl.num_programs(1) * G + kvh * G
    merge_heads(part_o, part_ml, out + t.to(tl.int64) * s_ot + kvh * G * s_oh, row0, n_sp, num_splits, num_rows,
                s_oh, G, G4, D, D_PAD, S_CHUNK)


_ATTN, _COMBINE = Launcher(_attn_kernel), Launcher(_combine_kernel)
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# (cache dtype, compute dtype) -> the register conversion of to_compute
_FAST = {(torch.int8, torch.bfloat16): 1, (torch.float8_e4m3fn, torch.float16): 2,
         (torch.float8_e5m2, torch.float16): 3, (torch.int8, torch.float16): 4}


def compute_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype Q and K/V enter the dot products in: the query's where the cache converts exactly.
    With :func:`fast_paths`, float16 for fp8 and int8 caches under a bf16 query (fp8 -> fp16 is one packed
    instruction, fp8 -> bf16 two; int8 -> fp16 two instructions a pair, int8 -> bf16 five; the query is
    pre-scaled, then rounded to fp16). Always float32 under TRITON_INTERPRET, whose bf16 dot multiplies raw
    bit patterns."""
    if interpreted() or query_dtype == torch.float32 or (cache_dtype in _TL and cache_dtype != query_dtype):
        return torch.float32
    if fast_paths() and query_dtype == torch.bfloat16 and cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2,
                                                                          torch.int8):
        return torch.float16
    return query_dtype


def scale_args(quant, k_cache, v_cache, k_scale, v_scale, k_scale_cache, v_scale_cache):
    """The kernels' scale arguments: the K and V scale caches (the caches themselves stand in where there are
    none), the scale caches' strides, and (scale, is pointer) of the per-tensor K and V scales."""
    per_token = quant == QUANT_TOKEN_HEAD
    ksc, vsc = (k_scale_cache, v_scale_cache) if per_token else (k_cache, v_cache)
    sc = k_scale_cache.stride() if per_token else (0, 0, 0)
    if quant != QUANT_TENSOR:
        return ksc, vsc, sc, (1.0, False), (1.0, False)
    return ksc, vsc, sc, scale_arg(k_scale), scale_arg(v_scale)


def default_splits(num_rows: int, max_ctx: int, device: torch.device, per_sm: int = 4,
                   whole_waves: bool = False) -> int:
    """KV splits for a decode launch: enough programs for ``per_sm`` per SM, splits of >= MIN_SPLIT_TOKENS.
    ``whole_waves``: one split (no combine kernel) where one program per row fills whole waves of one program
    per SM to at least WAVE_FILL (1-byte caches: BENCHMARKS.md "Round 4")."""
    sms = sm_count(device)
    if num_rows >= per_sm * sms:
        return 1
    if whole_waves and num_rows >= sms and num_rows >= WAVE_FILL * cdiv(num_rows, sms) * sms:
        return 1
    return max(1, min(cdiv(per_sm * sms, num_rows), max_ctx // MIN_SPLIT_TOKENS))


def paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, kv_dtype="auto",
                    k_scale=1.0, v_scale=1.0, k_scale_cache=None, v_scale_cache=None, whole_page_reads=False,
                    num_splits: int | None = None, block_n: int | None = None, num_warps: int = 4,
                    num_stages: int | None = None, cdt: torch.dtype | None = None, split_tokens: int | None = None):
    """See :func:`kvdiag.kernels.reference.paged_attention` (the keywords after it: tuning overrides).

    ``split_tokens``: decode splits of that many context tokens (rounded up to the tile), as many as the
    block table's width needs, instead of a split count chosen for the batch size: a token's result then
    depends on its own context only, not on the batch or the table's width (the engine's eager steps and
    CUDA graphs give the same bits)."""
    quant, _ = quant_params(kv_dtype)
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert block_tables.stride(1) == 1 and head_size >= 16
    group = num_heads // num_kv_heads
    decode = num_tokens <= num_seqs
    g_pad = next_pow2(group)
    g_pad, block_q = (max(16, g_pad), 1) if decode else (g_pad, max(1, BLOCK_M_PREFILL // g_pad))
    block_q = max(block_q, cdiv(16, g_pad))
    cdt = cdt or compute_dtype(query.dtype, k_cache.dtype)
    block_n = block_n or (128 if decode and k_cache.element_size() == 1 else 64)
    max_ctx = block_tables.shape[1] * page
    if not decode:
        num_splits = 1
    elif num_splits is None and not split_tokens:
        # per SM: 2 programs (2-byte caches), 16 (1-byte): the fastest measured (BENCHMARKS.md, round 1); 1-byte
        # caches with the fast paths: one split where the rows fill whole waves (round 4)
        one_byte = k_cache.element_size() == 1
        num_splits = default_splits(num_tokens * num_kv_heads, max_ctx, query.device, 16 if one_byte else 2,
                                    whole_waves=one_byte and fast_paths())
    if decode and split_tokens:
        split_len = cdiv(split_tokens, block_n) * block_n
    else:
        split_len = cdiv(cdiv(max_ctx, num_splits), block_n) * block_n
    num_splits = max(1, cdiv(max_ctx, split_len))
    d_pad = next_pow2(head_size)
    if num_splits > 1:
        part_o = torch.empty(num_tokens, num_heads, num_splits, d_pad, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(2, num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_o = part_ml = out
    ksc, vsc, sc, (ks, k_ptr), (vs, v_ptr) = scale_args(quant, k_cache, v_cache, k_scale, v_scale, k_scale_cache,
                                                         v_scale_cache)
    programs = num_tokens if decode else num_tokens // block_q + num_seqs
    fast = _FAST.get((k_cache.dtype, cdt), 0) if fast_paths() else 0
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _ATTN((num_kv_heads, programs, num_splits),
          (query, k_cache, v_cache, ksc, vsc, ks, vs, query_start_loc, seq_lens, block_tables, out, part_o, part_ml,
           float(scale), num_seqs, num_tokens, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
           *k_cache.stride()[:3], *sc[:3], block_tables.stride(0), split_len),
          dict(G=group, G_PAD=g_pad, D=head_size, D_PAD=d_pad, PAGE=page, BLOCK_Q=block_q, BLOCK_N=block_n,
               ADD_S=0 if decode else 1, QUANT=quant, K_PTR=k_ptr, V_PTR=v_ptr, WHOLE_PAGE=bool(whole_page_reads),
               SPLIT=num_splits > 1, CDT=_TL[cdt], PREC="ieee" if cdt == torch.float32 else None,
               FAST=fast, PRESCALE=cdt == torch.float16 and query.dtype != torch.float16, PURE_K=decode and fast > 0),
          num_warps=num_warps, **extra)
    if num_splits > 1:
        _COMBINE((num_tokens, num_kv_heads),
                 (part_o, part_ml, out, query_start_loc, seq_lens, out.stride(0), out.stride(1), num_splits,
                  num_tokens * num_heads, num_seqs, split_len),
                 dict(G=group, G4=next_pow2(group), D=head_size, D_PAD=d_pad, S_CHUNK=S_CHUNK, PAGE=page,
                      WHOLE_PAGE=bool(whole_page_reads)), num_warps=4)
    return out
