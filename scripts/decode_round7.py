"""Round 7 decode experiment (BENCHMARKS.md, "Round 7"): K and V pages loaded with TMA (Hopper tensor descriptors).

The cache [num_blocks, block_size, kv_heads, head] viewed as a 2-D tensor [num_blocks * block_size,
kv_heads * head]: one page of one kv head is the box [block_size, head] at (page * block_size, kv_head * head),
one plain 2-D TMA load (``desc.load``), which Triton pipelines on Hopper (async TMA + mbarriers) over
``num_stages``. The decode-only kernel here runs one program per (kv head, token) like the kept kernel (one
split), with the kept kernel's arithmetic (``attention.to_compute``: PURE_K conversion of K in the dot operand's
layout, int8 and fp8 into fp16 dots, per-token-head scales on the scores and on p; the scale caches stay pointer
loads). A tile is ``P`` pages (BLOCK_N = 16 P): ``lazy`` 0 does an online-softmax step per page, ``lazy`` 1 one
per tile (all P pages' scores first, then the P V dots), ``lazy`` 2 joins the P pages into one [16 P, head] tile
(``tl.join``/``permute``/``reshape``) and does one dot for K and one for V, like the kept kernel. ``tma`` 0: the
same kernel with pointer loads (the control); ``host`` 1: descriptors built on the host (``TensorDescriptor``,
launched through Triton's dispatch) instead of in the kernel (``tl.make_tensor_descriptor``, a global scratch
allocator). ``ids`` 1: a tile's page ids as one vector load (see ``_page_ids``). ``pure_v``: V converted in
the dot operand's layout as well.

Each variant is checked against the float64 reference (``kernels/reference.py``) and for the same bits on a
repeat, then timed as ``kvdiag bench`` times (``do_bench``, L2 flushed), ``--reps`` times round-robin with the kept
``paged_attention`` in the same process; medians x copy (copy measured in the same run).

    python3 scripts/decode_round7.py --sweep N --top 10 --out decode_round7_h100.json   # on the GPU
    TRITON_INTERPRET=1 python3 scripts/decode_round7.py --quick          # CPU: tiny ragged batch vs the reference

Runs on the H100 (``variants`` says what each sweep holds): sweep 1 ``decode_round7_h100.json`` (its variants
predate the ``ids`` key: scalar page-id loads), 2 ``decode_round7b_h100.json``, 3 ``decode_round7c_h100.json``
(``--top 10 --reps 3``), 4 ``decode_round7d_h100.json`` (``--reps 5``, every variant timed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from kvdiag.kernels import attention, reference
from kvdiag.kernels.attention import _FAST, _TL, LOG2E, NEG_BIG, compute_dtype, to_compute
from kvdiag.kernels.bench import copy_gbps, time_ms
from kvdiag.kernels.launch import Launcher
from kvdiag.kernels.store import fast_paths, load_scale, quant_params

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_sweep import DTYPES, batch, compile_variants, reference_and_current  # noqa: E402

if torch.cuda.is_available():  # device-side tensor descriptors need a global scratch buffer per launch
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@triton.jit
def _page_ids(block_tables, t, bt_s, p0, n_pages, P: tl.constexpr, IDS: tl.constexpr):
    """The page ids of pages ``p0 .. p0 + P - 1`` of token ``t``'s table (0 past its end), a tuple of scalars:
    IDS 0: a scalar load each; IDS 1: one vector load (16 ids at least), each id picked by a masked sum (a scalar
    load feeding the page loads kept Triton from pipelining them: one buffer whatever ``num_stages``)."""
    ids = ()
    if IDS:
        PV: tl.constexpr = 16 if P < 16 else P
        jr = tl.arange(0, PV)
        pgv = tl.load(block_tables + t * bt_s + p0 + jr, mask=(jr < P) & (p0 + jr < n_pages), other=0)
        for j in tl.static_range(P):
            ids = ids + (tl.sum(tl.where(jr == j, pgv, 0), 0),)
    else:
        for j in tl.static_range(P):
            ids = ids + (tl.load(block_tables + t * bt_s + p0 + j, mask=p0 + j < n_pages, other=0),)
    return ids


@triton.jit
def _page(kd, vd, k_cache, v_cache, page, kvh, in_page, d,
          KVH: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TMA: tl.constexpr, WHICH: tl.constexpr):
    """Codes of page ``page``, kv head ``kvh``: [PAGE, D] (WHICH 0: K, 1: V), and the page id."""
    if TMA:
        if WHICH == 0:
            x = kd.load([page * PAGE, kvh * D])
        else:
            x = vd.load([page * PAGE, kvh * D])
    else:
        off = page.to(tl.int64) * (PAGE * KVH * D) + kvh * D + in_page[:, None] * (KVH * D) + d[None, :]
        if WHICH == 0:
            x = tl.load(k_cache + off)
        else:
            x = tl.load(v_cache + off)
    return x, page


@triton.jit
def _page_scores(qt, kd, vd, k_cache, v_cache, k_scale_cache, page, pi, ctx, qk_scale, kvh, in_page, d, sc_b, sc_o,
                 sc_h, KVH: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TMA: tl.constexpr, QUANT: tl.constexpr,
                 CDT: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, PURE_K: tl.constexpr):
    """Scaled, masked scores [G_PAD, PAGE] of the token's page ``pi`` (id ``page``), the page id and the offsets
    of its per-token-head scales."""
    kraw, page = _page(kd, vd, k_cache, v_cache, page, kvh, in_page, d, KVH, D, PAGE, TMA, 0)
    scores = tl.dot(qt, tl.trans(to_compute(kraw, CDT, FAST, PURE_K)), input_precision=PREC)
    sc_off = page.to(tl.int64) * sc_b + in_page * sc_o + kvh * sc_h
    if QUANT == 2:
        scores = scores * tl.load(k_scale_cache + sc_off)[None, :]
    return tl.where((pi * PAGE + in_page < ctx)[None, :], scores * qk_scale, float("-inf")), page, sc_off


@triton.jit
def _cat2(a, b):
    """[R, D] and [R, D] -> [2R, D] (a's rows, then b's), through join / permute / reshape."""
    R: tl.constexpr = a.shape[0]
    D: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * R, D))


@triton.jit
def _stack(kd, vd, k_cache, v_cache, ids, kvh, in_page, d, KVH: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
           TMA: tl.constexpr, WHICH: tl.constexpr, P: tl.constexpr):
    """The P pages ``ids`` of kv head ``kvh`` as one [P * PAGE, D] tile (P in 1, 2, 4, 8)."""
    x0, _ = _page(kd, vd, k_cache, v_cache, ids[0], kvh, in_page, d, KVH, D, PAGE, TMA, WHICH)
    if P >= 2:
        x1, _ = _page(kd, vd, k_cache, v_cache, ids[1], kvh, in_page, d, KVH, D, PAGE, TMA, WHICH)
        x0 = _cat2(x0, x1)
    if P >= 4:
        x2, _ = _page(kd, vd, k_cache, v_cache, ids[2], kvh, in_page, d, KVH, D, PAGE, TMA, WHICH)
        x3, _ = _page(kd, vd, k_cache, v_cache, ids[3], kvh, in_page, d, KVH, D, PAGE, TMA, WHICH)
        x0 = _cat2(x0, _cat2(x2, x3))
    if P >= 8:
        x4, _ = _page(kd, vd, k_cache, v_cache, ids[4], kvh, in_page, d, KVH, D, PAGE, TMA, WHICH)
        x5, _ = _page(kd, vd, k_cache, v_cache, ids[5], kvh, in_page, d, KVH, D, PAGE, TMA, WHICH)
        x6, _ = _page(kd, vd, k_cache, v_cache, ids[6], kvh, in_page, d, KVH, D, PAGE, TMA, WHICH)
        x7, _ = _page(kd, vd, k_cache, v_cache, ids[7], kvh, in_page, d, KVH, D, PAGE, TMA, WHICH)
        x0 = _cat2(x0, _cat2(_cat2(x4, x5), _cat2(x6, x7)))
    return x0


@triton.jit
def _tma_kernel(q, k_cache, v_cache, k_scale_cache, v_scale_cache, k_scale, v_scale, seq_lens, block_tables, out,
                sm_scale, n_rows, s_qt, s_qh, s_ot, s_oh, sc_b, sc_o, sc_h, bt_s,
                G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, KVH: tl.constexpr,
                P: tl.constexpr, QUANT: tl.constexpr, K_PTR: tl.constexpr, V_PTR: tl.constexpr, CDT: tl.constexpr,
                PREC: tl.constexpr, FAST: tl.constexpr, PRESCALE: tl.constexpr, PURE_K: tl.constexpr,
                PURE_V: tl.constexpr, LAZY: tl.constexpr, TMA: tl.constexpr, HOST: tl.constexpr, IDS: tl.constexpr):
    """Decode (one query token per sequence, token t of sequence t), one program per (kv head, token), no split."""
    kvh, t = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(seq_lens + t)
    rows = tl.arange(0, G_PAD)
    head = kvh * G + rows
    row_ok = rows < G
    d = tl.arange(0, D)
    in_page = tl.arange(0, PAGE)
    qt = tl.load(q + t.to(tl.int64) * s_qt + head[:, None] * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    qk_scale = sm_scale * LOG2E
    if QUANT == 1:
        qk_scale = qk_scale * load_scale(k_scale, K_PTR)
    if PRESCALE:
        qt = (qt.to(tl.float32) * qk_scale).to(CDT)
        qk_scale = 1.0
    else:
        qt = qt.to(CDT)
    if HOST:
        kd = k_cache
        vd = v_cache
    elif TMA:
        kd = tl.make_tensor_descriptor(k_cache, shape=[n_rows, KVH * D], strides=[KVH * D, 1], block_shape=[PAGE, D])
        vd = tl.make_tensor_descriptor(v_cache, shape=[n_rows, KVH * D], strides=[KVH * D, 1], block_shape=[PAGE, D])
    else:
        kd = k_cache
        vd = v_cache
    m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    n_pages = tl.cdiv(ctx, PAGE)
    for p0 in range(0, n_pages, P):
        ids = _page_ids(block_tables, t, bt_s, p0, n_pages, P, IDS)
        if LAZY == 2:  # one [16 P, D] tile of K and of V, one dot each (the kept kernel's tile)
            offs = p0 * PAGE + tl.arange(0, P * PAGE)
            k = _stack(kd, vd, k_cache, v_cache, ids, kvh, in_page, d, KVH, D, PAGE, TMA, 0, P)
            scores = tl.dot(qt, tl.trans(to_compute(k, CDT, FAST, PURE_K)), input_precision=PREC)
            if QUANT == 2:
                pg = tl.load(block_tables + t * bt_s + offs // PAGE, mask=offs < ctx, other=0).to(tl.int64)
                sc_off = pg * sc_b + (offs % PAGE) * sc_o + kvh * sc_h
                scores = scores * tl.load(k_scale_cache + sc_off)[None, :]
            scores = tl.where((offs < ctx)[None, :], scores * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _stack(kd, vd, k_cache, v_cache, ids, kvh, in_page, d, KVH, D, PAGE, TMA, 1, P)
            if QUANT == 2:
                p = p * tl.load(v_scale_cache + sc_off)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(CDT), to_compute(v, CDT, FAST, PURE_V), input_precision=PREC)
            m_i = m_new
        elif LAZY:
            ss = ()
            pages = ()
            m_new = m_i
            for j in tl.static_range(P):
                scores, page, sc_off = _page_scores(qt, kd, vd, k_cache, v_cache, k_scale_cache, ids[j], p0 + j, ctx,
                                                    qk_scale, kvh, in_page, d, sc_b, sc_o, sc_h, KVH, D, PAGE, TMA,
                                                    QUANT, CDT, PREC, FAST, PURE_K)
                m_new = tl.maximum(m_new, tl.max(scores, 1))
                ss = ss + (scores,)
                pages = pages + (page,)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            for j in tl.static_range(P):
                p = tl.exp2(ss[j] - m_new[:, None])
                l_i = l_i + tl.sum(p, 1)
                vraw, _ = _page(kd, vd, k_cache, v_cache, ids[j], kvh, in_page, d,
                                KVH, D, PAGE, TMA, 1)
                if QUANT == 2:
                    sc_off = pages[j].to(tl.int64) * sc_b + in_page * sc_o + kvh * sc_h
                    p = p * tl.load(v_scale_cache + sc_off)[None, :]
                acc = acc + tl.dot(p.to(CDT), to_compute(vraw, CDT, FAST, PURE_V), input_precision=PREC)
            m_i = m_new
        else:
            for j in tl.static_range(P):
                scores, page, sc_off = _page_scores(qt, kd, vd, k_cache, v_cache, k_scale_cache, ids[j], p0 + j, ctx,
                                                    qk_scale, kvh, in_page, d, sc_b, sc_o, sc_h, KVH, D, PAGE, TMA,
                                                    QUANT, CDT, PREC, FAST, PURE_K)
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(scores - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                vraw, _ = _page(kd, vd, k_cache, v_cache, ids[j], kvh, in_page, d,
                                KVH, D, PAGE, TMA, 1)
                if QUANT == 2:
                    p = p * tl.load(v_scale_cache + sc_off)[None, :]
                acc = acc * alpha[:, None] + tl.dot(p.to(CDT), to_compute(vraw, CDT, FAST, PURE_V),
                                                    input_precision=PREC)
                m_i = m_new
    if QUANT == 1:
        acc = acc * load_scale(v_scale, V_PTR)
    o = acc / l_i[:, None]
    tl.store(out + t.to(tl.int64) * s_ot + head[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=row_ok[:, None])


_TMA = Launcher(_tma_kernel)


def decode(b, v, compile_only=False):
    """Decode attention of batch ``b`` (one query token per sequence) by the TMA kernel, variant ``v`` (dict: pages,
    stages, warps, lazy, tma, host, pure_v)."""
    quant, _ = quant_params(b.kv_dtype)
    query, kc, vc = b.query, b.k_cache, b.v_cache
    n, heads, hd = query.shape
    nb, page, kvh, _ = kc.shape
    assert n == b.seq_lens.shape[0] and hd & (hd - 1) == 0
    group = heads // kvh
    out = torch.empty_like(query)
    cdt = compute_dtype(query.dtype, kc.dtype)
    fast = _FAST.get((kc.dtype, cdt), 0) if fast_paths() else 0
    ksc, vsc, sc, (ks, kp), (vs, vp) = attention.scale_args(quant, kc, vc, *b.args()[8:])
    kd, vd = kc, vc
    if v["host"]:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kd, vd = (TensorDescriptor(c.view(nb * page, kvh * hd), [nb * page, kvh * hd], [kvh * hd, 1], [page, hd])
                  for c in (kc, vc))
    args = (query, kd, vd, ksc, vsc, ks, vs, b.seq_lens, b.block_tables, out, float(b.scale), nb * page,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), *sc[:3], b.block_tables.stride(0))
    consts = dict(G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=hd, PAGE=page, KVH=kvh, P=v["pages"],
                  QUANT=quant, K_PTR=kp, V_PTR=vp, CDT=_TL[cdt], PREC="ieee" if cdt == torch.float32 else None,
                  FAST=fast, PRESCALE=cdt == torch.float16 and query.dtype != torch.float16, PURE_K=fast > 0,
                  PURE_V=bool(v["pure_v"]) and fast > 0, LAZY=int(v["lazy"]), TMA=bool(v["tma"] or v["host"]),
                  HOST=bool(v["host"]), IDS=v.get("ids", 0))
    opts = dict(num_warps=v["warps"], num_stages=v["stages"])
    if compile_only or v["host"]:  # host descriptors: through Triton's dispatch (it expands them)
        k = _tma_kernel[(kvh, n)](*args, **consts, **opts)
        return k if compile_only else out
    _TMA((kvh, n), args, consts, **opts)
    return out


def ir_facts(kern) -> dict:
    ptx, ttgir = kern.asm["ptx"], kern.asm["ttgir"]
    return {"tma": ptx.count("cp.async.bulk.tensor"), "mbarrier_wait": ptx.count("mbarrier.try_wait"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "mma_sync": ptx.count("mma.sync"),
            "async_tma_ttgir": ttgir.count("async_tma_copy_global_to_local"),
            "shared_bytes": kern.metadata.shared, "regs": getattr(kern, "n_regs", None),
            "spills": getattr(kern, "n_spills", None)}


def variants(sweep_no=1):
    """Sweep 1: pages per tile x stages x softmax step (lazy) x TMA or pointer loads, 4 warps (device
    descriptors), page ids as scalar loads; a few at 2 and 8 warps, host descriptors and V converted pure.
    Sweep 2: page ids as one vector load, more stages (Triton's buffers per TMA load: 1 up to 4 stages, 2 at 5-6
    at BLOCK_N 128), and the same side variants around P 8 at 5 and 6 stages. Sweep 3: ``lazy`` 2 (the pages joined
    into one tile), with pointer loads as the control, and sweep 2's best. Sweep 4: the best of each family again."""
    base = dict(pages=8, stages=3, warps=4, lazy=1, tma=1, host=0, pure_v=0, ids=0)
    out = []
    if sweep_no == 4:  # the table's variants, re-timed (the best of each family of sweeps 1-3)
        b = {**base, "pages": 8, "lazy": 1}
        return [{**b, "lazy": 0}, {**b, "warps": 2}, {**b, "stages": 5, "warps": 2, "ids": 1},
                {**b, "stages": 5, "ids": 1}, {**b, "stages": 5, "tma": 0}, {**b, "stages": 5, "ids": 1, "host": 1},
                {**b, "pages": 4, "stages": 5, "ids": 1}, {**b, "lazy": 2, "stages": 4, "warps": 2, "ids": 1},
                {**b, "lazy": 2, "stages": 4, "ids": 1}]
    if sweep_no == 3:  # the P pages joined into one tile, one dot for K and one for V (lazy 2)
        base = {**base, "ids": 1, "lazy": 2}
        out = [{**base, "pages": pages, "stages": stages} for pages in (4, 8) for stages in (3, 4, 5, 6)]
        for stages in (4, 5):
            out += [{**base, "stages": stages, "warps": 2}, {**base, "stages": stages, "warps": 8},
                    {**base, "stages": stages, "ids": 0}, {**base, "stages": stages, "pure_v": 1},
                    {**base, "stages": stages, "ids": 0, "tma": 0}]
        return out + [{**base, "lazy": 1, "stages": 5, "warps": 2}]
    if sweep_no == 2:  # the page ids as one vector load: Triton then multi-buffers the TMA loads at 5+ stages
        base = {**base, "ids": 1}
        for pages, stages in itertools.product((4, 8), (4, 5, 6, 7)):
            out.append({**base, "pages": pages, "stages": stages})
        for stages in (5, 6):
            out += [{**base, "stages": stages, "lazy": 0}, {**base, "stages": stages, "ids": 0},
                    {**base, "stages": stages, "host": 1}, {**base, "stages": stages, "pure_v": 1},
                    {**base, "stages": stages, "warps": 8}, {**base, "stages": stages, "warps": 2}]
        out += [{**base, "pages": 16, "stages": s} for s in (4, 5)]
        out += [{**base, "pages": 2, "stages": s} for s in (6, 8)]
        return out
    for pages, stages, lazy, tma in itertools.product((1, 2, 4, 8), (2, 3, 4), (0, 1), (1, 0)):
        if (pages == 1 and lazy) or (tma == 0 and stages == 4):
            continue
        out.append({**base, "pages": pages, "stages": stages, "lazy": lazy, "tma": tma})
    for pages in (4, 8):
        out += [{**base, "pages": pages, "warps": 2}, {**base, "pages": pages, "warps": 8},
                {**base, "pages": pages, "host": 1}, {**base, "pages": pages, "pure_v": 1}]
    out += [{**base, "pages": 1, "lazy": 0, "stages": 6}, {**base, "pages": 2, "lazy": 0, "stages": 6}]
    return out


def quick() -> int:
    """Interpreted check (TRITON_INTERPRET=1) on a tiny ragged decode batch against the float64 reference."""
    bad = 0
    for kv in ["auto", "fp8", "int8_per_token_head", "fp8_per_token_head", "bfloat16"]:
        b = batch(kv, "cpu", True)
        want = reference.paged_attention(*b.args()).double()
        for v in [dict(pages=p, stages=2, warps=4, lazy=lz, tma=tm, host=0, pure_v=0, ids=i)
                  for p, lz, tm, i in [(1, 0, 1, 0), (2, 0, 1, 0), (2, 1, 1, 0), (4, 1, 1, 0), (2, 1, 0, 0),
                                       (2, 1, 1, 1), (4, 0, 1, 1), (2, 1, 0, 1), (2, 2, 1, 1), (4, 2, 1, 0),
                                       (4, 2, 0, 0)]]:
            try:
                got = decode(b, v).double()
                err = float((got - want).abs().max() / want.abs().max())
            except Exception as e:  # noqa: BLE001 - reported
                print(f"{kv:20s} {v}: {type(e).__name__}: {str(e)[:200]}")
                bad += 1
                continue
            ok = err < 2e-5
            bad += not ok
            print(f"{kv:20s} {v}: rel err {err:.1e}" + ("" if ok else "  <-- FAIL"), flush=True)
    print("all ok" if not bad else f"{bad} FAILED")
    return int(bad > 0)


def name_of(v) -> str:
    return (f"P {v['pages']} (BLOCK_N {16 * v['pages']}) st {v['stages']} w {v['warps']} "
            + ("one tile" if v["lazy"] == 2 else f"lazy {v['lazy']}")
            + ("" if v["tma"] or v["host"] else " ptr") + (" host" if v["host"] else "")
            + (" pure_v" if v["pure_v"] else "") + (" ids-vector" if v.get("ids") else ""))


def sweep(dtypes, out_path, reps, jobs, sweep_no, top) -> int:
    """Compile every variant (worker processes), check each against the reference (and a repeat), then per dtype
    time the kept paged_attention and the variants ``reps`` times round-robin; medians x copy."""
    copy = copy_gbps("cuda")
    vs = variants(sweep_no)
    facts, errors = compile_variants([(kv, vs[i::4]) for kv in dtypes for i in range(4)], decode, ir_facts, jobs)
    out = {"copy_gbps": copy, "reps": reps, "dtypes": {}, "errors": errors}
    for kv in dtypes:
        b = batch(kv, "cuda", False)
        want, nbytes, _ = reference_and_current(b, copy)
        cur = attention.paged_attention(*b.args()).double()
        rows = {"current": dict(x=[], err=float((cur - want).abs().max() / want.abs().max()))}
        fns = {"current": lambda b=b: attention.paged_attention(*b.args())}
        for v in vs:
            if (kv, tuple(v.values())) not in facts:
                continue
            got = decode(b, v)
            err = float((got.double() - want).abs().max() / want.abs().max())
            same = torch.equal(decode(b, v), got)
            rows[name_of(v)] = dict(x=[], err=err, same_bits_again=same, variant=v, **facts[(kv, tuple(v.values()))])
            if same and err <= 1.5 * rows["current"]["err"] and torch.isfinite(got).all():
                fns[name_of(v)] = lambda v=v, b=b: decode(b, v)
        if top and len(fns) > top + 1:  # one timing each, then the best ``top`` round-robin
            first = {k: nbytes / time_ms(f) / 1e6 / copy for k, f in fns.items()}
            for k, x in first.items():
                rows[k]["first"] = x
            keep = sorted((k for k in fns if k != "current"), key=lambda k: -first[k])[:top]
            fns = {k: fns[k] for k in ["current", *keep]}
        for _ in range(reps):
            for k, f in fns.items():
                rows[k]["x"].append(nbytes / time_ms(f) / 1e6 / copy)
        ck = list(attention._ATTN.kernels.values())[-1] if attention._ATTN.kernels else None
        rows["current"].update(regs=getattr(ck, "n_regs", None), spills=getattr(ck, "n_spills", None),
                               shared_bytes=ck.metadata.shared if ck else None)
        out["dtypes"][kv] = rows
        print(f"== {kv}  (x copy, median of {reps}; copy {copy:.0f} GB/s)", flush=True)
        for k, r in sorted(rows.items(), key=lambda t: -(statistics.median(t[1]["x"]) if t[1]["x"] else
                                                        t[1].get("first", 0) - 1)):
            med = f"{statistics.median(r['x']):.3f}" if r["x"] else f"({r.get('first', float('nan')):.3f})"
            print(f"  {med:7s} err {r['err']:.1e} regs {r.get('regs')} spills {r.get('spills')} "
                  f"smem {r.get('shared_bytes')} tma {r.get('tma', '-')} {k}"
                  + ("" if r.get("same_bits_again", True) else " NOT-DETERMINISTIC"), flush=True)
        del b
    for e in errors[:6]:
        print("failed:", e)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="interpreted check against the reference (CPU)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=0, help="time all once, then only the best TOP round-robin")
    ap.add_argument("--sweep", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    a = ap.parse_args()
    if a.quick:
        return quick()
    return sweep(a.dtypes.split(","), a.out, a.reps, a.jobs, a.sweep, a.top)


if __name__ == "__main__":
    sys.exit(main())
