"""Experiment: decode attention with one program per (token, KV split) over ALL kv heads.

The engine's kernel (kvdiag/kernels/attention.py) runs one program per (kv head, token,
split), which reads 128-byte rows of a 1-byte cache strided by kv_heads x head_size; here a
program reads each block's rows of every kv head, [kv_heads, BLOCK_N, head] (for a whole page,
one contiguous region), and does all query heads at once with batched (3-D) dots. The partial
results go through the engine kernel's combine. Prints rel. error against the reference and
× copy against the current kernel at 32 seqs x 4096 ctx, 32/8 heads x 128, block size 16.

    python3 scripts/decode_heads_sweep.py            # on the GPU
    TRITON_INTERPRET=1 python3 scripts/decode_heads_sweep.py --quick   # CPU check of the kernel
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from kvdiag.kernels import attention, reference
from kvdiag.kernels.attention import _COMBINE, LOG2E, NEG_BIG, S_CHUNK, compute_dtype, to_compute
from kvdiag.kernels.bench import copy_gbps, kv_bytes, paged_batch, time_ms
from kvdiag.kernels.launch import cdiv, next_pow2
from kvdiag.kernels.store import fast_paths, load_scale, quant_params


@triton.jit
def _heads_kernel(q, k_cache, v_cache, k_scale_cache, v_scale_cache, k_scale, v_scale, seq_lens, block_tables,
                  part_o, part_ml, sm_scale, s_qt, s_qh, c_b, c_o, c_h, sc_b, sc_o, sc_h, bt_s, split_len,
                  KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, QUANT: tl.constexpr, K_PTR: tl.constexpr, V_PTR: tl.constexpr,
                  CDT: tl.constexpr, FAST: tl.constexpr, PRESCALE: tl.constexpr, STAGES: tl.constexpr):
    t, sp = tl.program_id(0), tl.program_id(1)  # decode: token t is sequence t
    ctx = tl.load(seq_lens + t)
    lo = sp * split_len
    if lo >= ctx:
        return
    hi = tl.minimum(lo + split_len, ctx)
    h = tl.arange(0, KVH)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    head = h[:, None] * G + g[None, :]  # [KVH, G_PAD]
    g_ok = (g < G)[None, :, None]
    qt = tl.load(q + t.to(tl.int64) * s_qt + head[:, :, None] * s_qh + d[None, None, :], mask=g_ok, other=0.0)
    qk_scale = sm_scale * LOG2E
    if QUANT == 1:
        qk_scale = qk_scale * load_scale(k_scale, K_PTR)
    if PRESCALE:
        qt = (qt.to(tl.float32) * qk_scale).to(CDT)
        qk_scale = 1.0
    else:
        qt = qt.to(CDT)
    m_i = tl.full([KVH, G_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([KVH, G_PAD], tl.float32)
    acc = tl.zeros([KVH, G_PAD, D], tl.float32)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK_N)
        ld = offs < hi
        page = tl.load(block_tables + t * bt_s + offs // PAGE, mask=ld, other=0).to(tl.int64)
        row = page * c_b + (offs % PAGE) * c_o  # [BLOCK_N]
        kv_off = h[:, None, None] * c_h + row[None, :, None] + d[None, None, :]  # [KVH, BLOCK_N, D]
        kv_mask = ld[None, :, None]
        k = to_compute(tl.load(k_cache + kv_off, mask=kv_mask, other=0.0), CDT, FAST)
        scores = tl.dot(qt, tl.permute(k, (0, 2, 1)))  # [KVH, G_PAD, BLOCK_N]
        if QUANT == 2:
            sc_off = h[:, None] * sc_h + (page * sc_b + (offs % PAGE) * sc_o)[None, :]  # [KVH, BLOCK_N]
            scores = scores * tl.load(k_scale_cache + sc_off, mask=ld[None, :], other=0.0)[:, None, :]
        scores = tl.where(ld[None, None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 2))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        v = to_compute(tl.load(v_cache + kv_off, mask=kv_mask, other=0.0), CDT, FAST)
        if QUANT == 2:
            p = p * tl.load(v_scale_cache + sc_off, mask=ld[None, :], other=0.0)[:, None, :]
        acc = acc * alpha[:, :, None] + tl.dot(p.to(CDT), v)
        m_i = m_new
    if QUANT == 1:
        acc = acc * load_scale(v_scale, V_PTR)
    num_splits = tl.num_programs(1)
    part = (t.to(tl.int64) * KVH * G + head) * num_splits + sp  # [KVH, G_PAD]
    ok = g[None, :] < G
    tl.store(part_o + part[:, :, None] * D + d[None, None, :], acc, mask=ok[:, :, None])
    tl.store(part_ml + part, m_i, mask=ok)
    tl.store(part_ml + tl.num_programs(0) * KVH * G * num_splits + part, l_i, mask=ok)


def heads_attention(b, num_splits, block_n, num_warps, stages):
    quant, _ = quant_params(b.kv_dtype)
    query, kc, vc = b.query, b.k_cache, b.v_cache
    n, heads, hd = query.shape
    kvh = kc.shape[2]
    cdt = compute_dtype(query.dtype, kc.dtype)
    max_ctx = b.block_tables.shape[1] * kc.shape[1]
    split_len = cdiv(cdiv(max_ctx, num_splits), block_n) * block_n
    num_splits = cdiv(max_ctx, split_len)
    out = torch.empty_like(query)
    part_o = torch.empty(n, heads, num_splits, hd, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(2, n, heads, num_splits, dtype=torch.float32, device=query.device)
    ksc, vsc, sc, (ks, kp), (vs, vp) = attention.scale_args(quant, kc, vc, *b.args()[8:])
    _heads_kernel[(n, num_splits)](
        query, kc, vc, ksc, vsc, ks, vs, b.seq_lens, b.block_tables, part_o, part_ml, float(b.scale),
        query.stride(0), query.stride(1), *kc.stride()[:3], *sc[:3], b.block_tables.stride(0), split_len,
        KVH=kvh, G=heads // kvh, G_PAD=max(16, next_pow2(heads // kvh)), D=hd, PAGE=kc.shape[1], BLOCK_N=block_n,
        QUANT=quant, K_PTR=kp, V_PTR=vp, CDT=attention._TL[cdt],
        FAST=attention._FAST.get((kc.dtype, cdt), 0) if fast_paths() else 0,
        PRESCALE=cdt == torch.float16 and query.dtype != torch.float16, STAGES=stages, num_warps=num_warps)
    g = heads // kvh
    _COMBINE((n, kvh), (part_o, part_ml, out, b.query_start_loc, b.seq_lens, out.stride(0), out.stride(1),
                        num_splits, n * heads, n, split_len),
             dict(G=g, G4=next_pow2(g), D=hd, D_PAD=hd, S_CHUNK=S_CHUNK, PAGE=kc.shape[1], WHOLE_PAGE=False),
             num_warps=4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes, no timing (checks the kernel)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.quick:
        seqs, ctx, heads, kvh, hd, bs, dt = 4, 70, 8, 2, 16, 4, torch.float32
        configs, dtypes = [(2, 16, 4, 1)], ["auto", "fp8", "int8_per_token_head"]
    else:
        seqs, ctx, heads, kvh, hd, bs, dt = 32, 4096, 32, 8, 128, 16, torch.bfloat16
        configs = list(itertools.product([8, 16, 32], [16, 32, 64], [4, 8], [2, 3]))
        dtypes = ["fp8", "int8_per_token_head", "fp8_per_token_head", "bfloat16"]
    copy = copy_gbps(dev) if dev == "cuda" else 1.0
    rows = []
    for kv in dtypes:
        b = paged_batch(kv, [1] * seqs, [ctx] * seqs, heads, kvh, hd, bs, dt, dev, seed=7)
        want = reference.paged_attention(*b.args()).double()
        nbytes = kv_bytes(b)
        base = time_ms(lambda: attention.paged_attention(*b.args())) if dev == "cuda" else 1.0
        print(f"{kv}: current kernel {base:.4f} ms, {nbytes / base / 1e6 / copy:.3f} x copy", flush=True)
        for splits, bn, warps, stages in configs:
            try:
                out = heads_attention(b, splits, bn, warps, stages)
                err = float((out.double() - want).norm() / want.norm())
                ms = time_ms(lambda: heads_attention(b, splits, bn, warps, stages)) if dev == "cuda" else 1.0
            except Exception as e:  # a config that does not compile (registers, shared memory)
                print(f"  splits {splits} bn {bn} warps {warps} stages {stages}: {type(e).__name__} {e}"[:300])
                continue
            r = dict(kv=kv, splits=splits, block_n=bn, warps=warps, stages=stages, ms=ms, err=err,
                     x_copy=nbytes / ms / 1e6 / copy, current_ms=base, current_x_copy=nbytes / base / 1e6 / copy)
            rows.append(r)
            print(f"  splits {splits:2d} bn {bn:3d} warps {warps} stages {stages}: {ms:.4f} ms "
                  f"{r['x_copy']:.3f} x copy, rel err {err:.1e}", flush=True)
    if a.out:
        json.dump({"copy_gbps": copy, "rows": rows}, open(a.out, "w"), indent=1)
    print("best per dtype (x copy; current kernel):")
    for kv in dtypes:
        rs = [r for r in rows if r["kv"] == kv and r["err"] < 2e-2]
        if rs:
            r = max(rs, key=lambda r: r["x_copy"])
            print(f"  {kv:22s} {r['x_copy']:.3f} (splits {r['splits']} bn {r['block_n']} warps {r['warps']} "
                  f"stages {r['stages']}, err {r['err']:.1e}); current {r['current_x_copy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
