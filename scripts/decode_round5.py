"""Round 5 decode experiment (BENCHMARKS.md, "Round 5"): a persistent "stream-K" decode kernel (not kept).

Decode's work is the flattened list of (row, tile) items, a row being one query token with one kv head (its
G query heads), a tile BLOCK_N context tokens. Rows are ordered by sequence, then token, then kv head; a
sequence without query tokens gets one dummy row of one tile per kv head (loads masked, nothing stored), so
the row walk needs no inner loop. ``P`` programs (SMs x ``pps``) each take a contiguous range of
``tot * pid // P .. tot * (pid + 1) // P`` items (the two loops over the sequences before the main loop
compute ``tot`` and locate the range's first item from the sequence lengths: no host sync). Row walks
(``adv``): 0 - ONE loop over the range's items, which Triton pipelines across row boundaries (as Triton's
persistent matmul tutorial): at a row change the row state (sequence, token, kv head, query tile) advances
inside an ``if``; at a row's (or the range's) last item the row is stored, or its part written; 1 - the same
with the row state advanced by selects (the sequence lengths loaded one row ahead), only the query reload in
an ``if``; 2 - a loop over the range's rows, each row's items in an inner pipelined loop (a pipeline ramp per
row). ``lock``: programs in groups of KVH, one per kv head, each group walking the same items of a list
with one kv head per token, so the programs reading a token slot's kv heads run at about the same time (as
in attention.py's grid). ``qeach``: the query loaded every item instead of carried.

Rows spanning several programs: each part (acc, running max m, sum l; fp32) goes to its program's slot (2 per
program: the range's first segment and its last); after the loop (an atomic inside it keeps Triton from
pipelining the loop) an ``atom.acq_rel.gpu`` counter of the row's first program counts the parts, and the
program whose increment completes the count merges the parts in program order from the slots (the same
bits whichever program merges), stores the row and resets the counter to 0 (counters allocated once per
device, zero between launches). No program waits for another, so the grid need not be resident.

Per-token-head scales fold as in attention.py (K scale on scores, V scale on p), int8 and fp8 into fp16
dots, K converted in the dot operand's layout (``PURE_K``). Each sweep compiles its variants in worker
processes (scripts/decode_sweep.py), then times the current ``paged_attention`` and each variant 3-5 times
round-robin (do_bench, L2 flushed; medians) at `kvdiag bench`'s decode size, block size 16 for every dtype
and 32 for int8_per_token_head (the 4 best variants there), checking each variant's error against the
reference, the same bits on a repeat and the counters back at zero. Recorded on the H100:
scripts/decode_round5_h100.json (``--sweep 1``), decode_round5b_h100.json (``--sweep 2``, run as
``--second``), decode_round5c_h100.json (3), decode_round5d_h100.json (4), decode_round5e_h100.json (5).

    TRITON_INTERPRET=1 python3 scripts/decode_round5.py --quick [--adv 0,2] [--qeach]   # CPU, vs the reference
    python3 scripts/decode_round5.py --sweep 4 --reps 5 --out decode_round5d.json        # GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

from kvdiag.kernels import attention, reference
from kvdiag.kernels.attention import _FAST, _TL, LOG2E, NEG_BIG, compute_dtype, to_compute
from kvdiag.kernels.bench import copy_gbps, kv_bytes, paged_batch, time_ms
from kvdiag.kernels.launch import Launcher, next_pow2, sm_count
from kvdiag.kernels.store import fast_paths, load_scale, quant_params

from decode_sweep import CTX, DTYPES, HD, HEADS, KVH, SEQS, compile_variants  # scripts/decode_sweep.py


@triton.jit
def seq_tiles(qsl, seq_lens, s, ok, KV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
              WHOLE_PAGE: tl.constexpr):
    """Sequence(s) ``s``: query start, end, context, tiles per row, rows (>= 1 per kv head)."""
    qs = tl.load(qsl + s, mask=ok, other=0)
    qe = tl.load(qsl + s + 1, mask=ok, other=0)
    ctx = tl.load(seq_lens + s, mask=ok, other=0)
    if WHOLE_PAGE:
        n_read = tl.cdiv(ctx, PAGE) * PAGE
    else:
        n_read = ctx
    nt = tl.where(qe > qs, tl.maximum(tl.cdiv(n_read, BLOCK_N), 1), 1)
    return qs, qe, ctx, nt, tl.maximum(qe - qs, 1) * KV


@triton.jit
def owner(g, tot, P):
    """The program whose range holds item ``g``: the largest p with p * tot // P <= g."""
    return (((g.to(tl.int64) + 1) * P - 1) // tot).to(tl.int32)


@triton.jit
def merge_row(part_o, part_ml, counters, o_ptr, rs, re, tot, P, lanes, kv0, vs, s_oh, G: tl.constexpr,
              G4: tl.constexpr,
              D: tl.constexpr, D_PAD: tl.constexpr):
    """The row of items rs .. re - 1: its parts (programs owner(rs) .. owner(re - 1)) merged in program order,
    stored at ``o_ptr``; the first program's counter reset for the next launch."""
    g = tl.arange(0, G4)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    pa = owner(rs, tot, P)
    pb = owner(re - 1, tot, P)
    m = tl.full([G4], NEG_BIG, tl.float32)
    lsum = tl.zeros([G4], tl.float32)
    acc = tl.zeros([G4, D_PAD], tl.float32)
    for p in range(pa, pb + 1):
        side = ((p == pa) & (rs > (tot.to(tl.int64) * p // P).to(tl.int32))).to(tl.int32)
        slot = (2 * (p * lanes + kv0) + side) * G + g
        mp = tl.load(part_ml + slot, mask=g_ok, other=NEG_BIG, cache_modifier=".cg")
        lp = tl.load(part_ml + 2 * tl.num_programs(0) * G + slot, mask=g_ok, other=0.0, cache_modifier=".cg")
        ap = tl.load(part_o + slot[:, None] * D_PAD + d[None, :], mask=g_ok[:, None], other=0.0,
                     cache_modifier=".cg")
        m_new = tl.maximum(m, mp)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(mp - m_new)
        acc = acc * alpha[:, None] + ap * beta[:, None]
        lsum = lsum * alpha + lp * beta
        m = m_new
    o = acc * vs / lsum[:, None]
    tl.store(o_ptr + g[:, None] * s_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=g_ok[:, None] & (d[None, :] < D))
    tl.atomic_xchg(counters + pa * lanes + kv0, 0, sem="relaxed", scope="gpu")


@triton.jit
def load_q(q, t, qe, kvh, s_qt, s_qh, qk_scale, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
           D_PAD: tl.constexpr, CDT: tl.constexpr, PRESCALE: tl.constexpr):
    """Token t's query heads of kv head kvh, [G_PAD, D_PAD] in the dot's dtype (zeros where t >= qe)."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    qt = tl.load(q + t.to(tl.int64) * s_qt + (kvh * G + g)[:, None] * s_qh + d[None, :],
                 mask=((g < G) & (g * 0 + t < qe))[:, None] & (d[None, :] < D), other=0.0)
    if PRESCALE:  # a bf16 query entering an fp16 dot: scale first, away from fp16's overflow
        qt = (qt.to(tl.float32) * qk_scale).to(CDT)
    else:
        qt = qt.to(CDT)
    return qt


@triton.jit
def count_part(part_o, part_ml, counters, o_ptr, rs, re, tot, P, lanes, kv0, vs, s_oh, G: tl.constexpr,
               G4: tl.constexpr,
               D: tl.constexpr, D_PAD: tl.constexpr):
    """Count this program's (stored) part of the row of items rs .. re - 1; the program completing the count
    merges the row."""
    parts = owner(re - 1, tot, P) - owner(rs, tot, P) + 1
    if tl.atomic_add(counters + owner(rs, tot, P) * lanes + kv0, 1, sem="acq_rel", scope="gpu") == parts - 1:
        merge_row(part_o, part_ml, counters, o_ptr, rs, re, tot, P, lanes, kv0, vs, s_oh, G, G4, D, D_PAD)


@triton.jit
def next_row(qsl, seq_lens, num_seqs, s, jq, kvh, qs, qe, re, KV: tl.constexpr, PAGE: tl.constexpr,
             BLOCK_N: tl.constexpr, WHOLE_PAGE: tl.constexpr):
    """The row after (sequence s, its query token jq, kv head kvh) ending at item re: the next kv head, else the
    next token, else the next sequence (one dummy token where a sequence has none)."""
    kvh += 1
    wrap = kvh == KV
    kvh = tl.where(wrap, 0, kvh)
    jq = tl.where(wrap, jq + 1, jq)
    nxt = jq == tl.maximum(qe - qs, 1)
    s = tl.where(nxt, s + 1, s)
    jq = tl.where(nxt, 0, jq)
    qs, qe, ctx, nt, _ = seq_tiles(qsl, seq_lens, s, s < num_seqs, KV, PAGE, BLOCK_N, WHOLE_PAGE)
    return s, jq, kvh, qs, qe, ctx, nt, re, re + nt


@triton.jit
def row_span(ctx, qe, t, PAGE: tl.constexpr, WHOLE_PAGE: tl.constexpr):
    """Token t's position and how many of its context tokens are read (0 for a dummy row)."""
    pos = ctx - qe + t
    if WHOLE_PAGE:
        hi = tl.cdiv(ctx, PAGE) * PAGE
    else:
        hi = pos + 1
    return pos, tl.where(t < qe, hi, 0)


@triton.jit
def attend_tile(qt, m_i, l_i, acc, j, s, kvh, ctx, pos, hi, qk_scale, k_cache, v_cache, k_scale_cache, v_scale_cache,
                block_tables, bt_s, c_b, c_o, c_h, sc_b, sc_o, sc_h, D: tl.constexpr, D_PAD: tl.constexpr,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, CDT: tl.constexpr,
                PREC: tl.constexpr, FAST: tl.constexpr, PRESCALE: tl.constexpr, PURE_K: tl.constexpr):
    """Online softmax over tile j (tokens j * BLOCK_N ..) of a row: attention.py's decode loop body."""
    d = tl.arange(0, D_PAD)
    offs = j * BLOCK_N + tl.arange(0, BLOCK_N)
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
    allowed = (offs <= pos) & (offs < ctx) & (offs < hi)  # offs < hi: nothing for a dummy row
    if PRESCALE:
        scores = tl.where(allowed[None, :], scores, float("-inf"))
    else:
        scores = tl.where(allowed[None, :], scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = to_compute(tl.load(v_cache + kv_off, mask=kv_mask, other=0.0), CDT, FAST)
    if QUANT == 2:
        p = p * tl.load(v_scale_cache + sc_off, mask=ld, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def finish_segment(out, part_o, part_ml, acc, m_i, l_i, vs, t, qe, kvh, rs, re, t_lo, t_hi, pid, P, s_ot, s_oh,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """A row's segment done: the whole row in this range is stored; a part of a row spanning several programs
    goes to the program's slot (0: the range's first segment, 1: its last), counted after the loop."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    if (rs >= t_lo) & (re <= t_hi):
        o = acc * vs / l_i[:, None]
        tl.store(out + t.to(tl.int64) * s_ot + (kvh * G + g)[:, None] * s_oh + d[None, :],
                 o.to(out.dtype.element_ty), mask=(g_ok & (g * 0 + t < qe))[:, None] & (d[None, :] < D))
    else:
        slot = (2 * pid + (rs > t_lo).to(tl.int32)) * G + g
        tl.store(part_o + slot[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml + slot, m_i, mask=g_ok)
        tl.store(part_ml + 2 * tl.num_programs(0) * G + slot, l_i, mask=g_ok)


@triton.jit
def _persist_kernel(q, k_cache, v_cache, k_scale_cache, v_scale_cache, k_scale, v_scale, qsl, seq_lens, block_tables,
                    out, part_o, part_ml, counters, sm_scale, num_seqs, s_qt, s_qh, s_ot, s_oh, c_b, c_o, c_h,
                    sc_b, sc_o, sc_h, bt_s, lanes,
                    KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, G4: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                    K_PTR: tl.constexpr, V_PTR: tl.constexpr, WHOLE_PAGE: tl.constexpr, CDT: tl.constexpr,
                    PREC: tl.constexpr, FAST: tl.constexpr, PRESCALE: tl.constexpr, PURE_K: tl.constexpr,
                    SB: tl.constexpr, REVERSE: tl.constexpr, ADV: tl.constexpr, QEACH: tl.constexpr):
    P = tl.num_programs(0)
    pid = tl.program_id(0)
    if REVERSE:  # tests: the programs' order reversed (the interpreter runs them one after another)
        pid = P - 1 - pid
    # lanes > 1 (LOCK): programs pid = group * lanes + kv0 walk the same items of kv head kv0 (rows list one kv
    # head), so a group's programs read the same token slots at about the same time
    kv0 = pid % lanes
    grp = pid // lanes
    P = P // lanes
    sv = tl.arange(0, SB)
    tot = 0
    for c in range(0, num_seqs, SB):
        ok = c + sv < num_seqs
        _, _, _, nt_v, rows_v = seq_tiles(qsl, seq_lens, c + sv, ok, KV, PAGE, BLOCK_N, WHOLE_PAGE)
        tot += tl.sum(tl.where(ok, nt_v * rows_v, 0))
    P = tl.minimum(P, tot)  # every range non-empty (a row's parts are the programs owner(rs) .. owner(re - 1))
    t_lo = (grp.to(tl.int64) * tot // P).to(tl.int32)
    t_hi = ((grp + 1).to(tl.int64) * tot // P).to(tl.int32)
    if grp >= P:
        return
    # the sequence holding item t_lo, and the items before it
    s = 0
    b0 = 0
    base = 0
    for c in range(0, num_seqs, SB):
        ok = c + sv < num_seqs
        _, _, _, nt_v, rows_v = seq_tiles(qsl, seq_lens, c + sv, ok, KV, PAGE, BLOCK_N, WHOLE_PAGE)
        w = tl.where(ok, nt_v * rows_v, 0)
        cum = tl.cumsum(w, 0) + base
        s += tl.sum((ok & (cum <= t_lo)).to(tl.int32))
        b0 += tl.sum(tl.where(ok & (cum > t_lo) & (cum - w <= t_lo), cum - w, 0))
        base += tl.sum(w)
    qs, qe, ctx, nt, _ = seq_tiles(qsl, seq_lens, s, s < num_seqs, KV, PAGE, BLOCK_N, WHOLE_PAGE)
    off = t_lo - b0
    jq = off // nt // KV  # query token of the sequence
    kvh = off // nt % KV
    rs = t_lo - off % nt  # the row's first item
    re = rs + nt
    f_rs, f_re, f_t, f_kvh = rs, re, qs + jq, kvh

    qk_scale = sm_scale * LOG2E
    if QUANT == 1:
        qk_scale = qk_scale * load_scale(k_scale, K_PTR)
        vs = load_scale(v_scale, V_PTR)
    else:
        vs = 1.0
    t = qs + jq
    qt = load_q(q, t, qe, kvh + kv0, s_qt, s_qh, qk_scale, G, G_PAD, D, D_PAD, CDT, PRESCALE)
    if ADV == 1:  # the next sequence's lengths, loaded a row ahead
        qs1, qe1, ctx1, nt1, _ = seq_tiles(qsl, seq_lens, s + 1, s + 1 < num_seqs, KV, PAGE, BLOCK_N, WHOLE_PAGE)
    m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if ADV == 2:  # a loop over rows, each row's tiles in an inner (pipelined) loop: a pipeline ramp per row
        it = t_lo
        while it < t_hi:
            seg_end = tl.minimum(re, t_hi)
            pos, hi = row_span(ctx, qe, t, PAGE, WHOLE_PAGE)
            m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D_PAD], tl.float32)
            for j in range(it - rs, seg_end - rs):
                m_i, l_i, acc = attend_tile(qt, m_i, l_i, acc, j, s, kvh + kv0, ctx, pos, hi, qk_scale, k_cache,
                                            v_cache, k_scale_cache, v_scale_cache, block_tables, bt_s, c_b, c_o, c_h,
                                            sc_b, sc_o, sc_h, D, D_PAD, PAGE, BLOCK_N, QUANT, CDT, PREC, FAST,
                                            PRESCALE, PURE_K)
            finish_segment(out, part_o, part_ml, acc, m_i, l_i, vs, t, qe, kvh + kv0, rs, re, t_lo, t_hi, pid, P, s_ot,
                           s_oh, G, G_PAD, D, D_PAD)
            it = seg_end
            if it < t_hi:
                s, jq, kvh, qs, qe, ctx, nt, rs, re = next_row(qsl, seq_lens, num_seqs, s, jq, kvh, qs, qe, re, KV,
                                                                PAGE, BLOCK_N, WHOLE_PAGE)
                t = qs + jq
                qt = load_q(q, t, qe, kvh + kv0, s_qt, s_qh, qk_scale, G, G_PAD, D, D_PAD, CDT, PRESCALE)
    else:  # one flattened loop over the range's items
        for it in range(t_lo, t_hi):
            if ADV == 0:
                if it == re:
                    s, jq, kvh, qs, qe, ctx, nt, rs, re = next_row(qsl, seq_lens, num_seqs, s, jq, kvh, qs, qe, re,
                                                                    KV, PAGE, BLOCK_N, WHOLE_PAGE)
                    t = qs + jq
                    if not QEACH:
                        qt = load_q(q, t, qe, kvh + kv0, s_qt, s_qh, qk_scale, G, G_PAD, D, D_PAD, CDT, PRESCALE)
                if QEACH:  # the query loaded every item (from L1), not carried through the pipeline's stages
                    qt = load_q(q, t, qe, kvh + kv0, s_qt, s_qh, qk_scale, G, G_PAD, D, D_PAD, CDT, PRESCALE)
            else:  # the same, branch-free (selects), so the tile's addresses depend on no branch; only the
                # query reload is one
                adv = it == re
                kvh_n = kvh + 1
                wrap = kvh_n == KV
                kvh_n = tl.where(wrap, 0, kvh_n)
                jq_n = tl.where(wrap, jq + 1, jq)
                nxt = adv & (jq_n == tl.maximum(qe - qs, 1))
                kvh = tl.where(adv, kvh_n, kvh)
                jq = tl.where(nxt, 0, tl.where(adv, jq_n, jq))
                s = tl.where(nxt, s + 1, s)
                qs = tl.where(nxt, qs1, qs)
                qe = tl.where(nxt, qe1, qe)
                ctx = tl.where(nxt, ctx1, ctx)
                nt = tl.where(nxt, nt1, nt)
                rs = tl.where(adv, re, rs)
                re = tl.where(adv, re + nt, re)
                t = qs + jq
                qs1, qe1, ctx1, nt1, _ = seq_tiles(qsl, seq_lens, s + 1, s + 1 < num_seqs, KV, PAGE, BLOCK_N,
                                                   WHOLE_PAGE)
                if adv:
                    qt = load_q(q, t, qe, kvh + kv0, s_qt, s_qh, qk_scale, G, G_PAD, D, D_PAD, CDT, PRESCALE)
            pos, hi = row_span(ctx, qe, t, PAGE, WHOLE_PAGE)
            m_i, l_i, acc = attend_tile(qt, m_i, l_i, acc, it - rs, s, kvh + kv0, ctx, pos, hi, qk_scale, k_cache,
                                        v_cache, k_scale_cache, v_scale_cache, block_tables, bt_s, c_b, c_o, c_h, sc_b,
                                        sc_o, sc_h, D, D_PAD, PAGE, BLOCK_N, QUANT, CDT, PREC, FAST, PRESCALE, PURE_K)
            if (it + 1 == re) | (it + 1 == t_hi):  # the row's (or the range's) last item (an atomic here would
                # keep Triton from pipelining the loop: parts are counted after it)
                finish_segment(out, part_o, part_ml, acc, m_i, l_i, vs, t, qe, kvh + kv0, rs, re, t_lo, t_hi, pid, P,
                               s_ot, s_oh, G, G_PAD, D, D_PAD)
                m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
                l_i = tl.zeros([G_PAD], tl.float32)
                acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    first_split = (f_rs < t_lo) | (f_re > t_hi)
    last_split = ((rs < t_lo) | (re > t_hi)) & (rs != f_rs)
    if first_split | last_split:
        tl.debug_barrier()  # every thread's partial stores precede the releases below
    if first_split:
        count_part(part_o, part_ml, counters, out + f_t.to(tl.int64) * s_ot + (f_kvh + kv0) * G * s_oh, f_rs, f_re, tot,
                   P, lanes, kv0, vs, s_oh, G, G4, D, D_PAD)
    if last_split:
        count_part(part_o, part_ml, counters, out + t.to(tl.int64) * s_ot + (kvh + kv0) * G * s_oh, rs, re, tot, P,
                   lanes, kv0, vs, s_oh, G, G4, D, D_PAD)


_PERSIST = Launcher(_persist_kernel)
_COUNTERS: dict = {}


def counters(device, n: int) -> torch.Tensor:
    """Per-device int32 counters, zero between launches (each launch resets those it used)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def decode(b, v, compile_only=False, whole_page=False, reverse=False, programs=None):
    """Decode attention of batch ``b`` by the persistent kernel, variant ``v`` (dict: pps, block_n, warps, stages);
    ``programs`` overrides SMs x pps."""
    quant, _ = quant_params(b.kv_dtype)
    query, kc, vc = b.query, b.k_cache, b.v_cache
    n, heads, hd = query.shape
    kvh, page = kc.shape[2], kc.shape[1]
    group = heads // kvh
    num_seqs = b.seq_lens.shape[0]
    lanes = kvh if v.get("lock") else 1
    P = (programs or v["pps"] * sm_count(query.device)) // lanes * lanes
    d_pad = next_pow2(hd)
    out = torch.empty_like(query)
    part_o = torch.empty(2 * P, group, d_pad, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(2, 2 * P, group, dtype=torch.float32, device=query.device)
    cnt = counters(query.device, P)
    cdt = compute_dtype(query.dtype, kc.dtype)
    fast = _FAST.get((kc.dtype, cdt), 0) if fast_paths() else 0
    ksc, vsc, sc, (ks, kp), (vs, vp) = attention.scale_args(quant, kc, vc, *b.args()[8:])
    args = (query, kc, vc, ksc, vsc, ks, vs, b.query_start_loc, b.seq_lens, b.block_tables, out, part_o, part_ml, cnt,
            float(b.scale), num_seqs, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *kc.stride()[:3], *sc[:3], b.block_tables.stride(0), lanes)
    consts = dict(KV=kvh // lanes, G=group, G_PAD=max(16, next_pow2(group)), G4=next_pow2(group), D=hd, D_PAD=d_pad,
                  PAGE=page, BLOCK_N=v["block_n"], QUANT=quant, K_PTR=kp, V_PTR=vp, WHOLE_PAGE=whole_page,
                  CDT=_TL[cdt], PREC="ieee" if cdt == torch.float32 else None, FAST=fast,
                  PRESCALE=cdt == torch.float16 and query.dtype != torch.float16, PURE_K=fast > 0,
                  SB=min(256, max(16, next_pow2(num_seqs))), REVERSE=reverse, ADV=v.get("adv", 0),
                  QEACH=bool(v.get("qeach")))
    opts = dict(num_warps=v["warps"], num_stages=v["stages"])
    if v.get("maxnreg"):
        opts["maxnreg"] = v["maxnreg"]
    if compile_only:
        return _persist_kernel[(P,)](*args, **consts, **opts)
    _PERSIST((P,), args, consts, **opts)
    return out


def ir_facts(kern) -> dict:
    ptx = kern.asm["ptx"]
    return {"cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "mma_sync": ptx.count("mma.sync"),
            "shared_bytes": kern.metadata.shared, "regs": getattr(kern, "n_regs", None),
            "spills": getattr(kern, "n_spills", None)}


def variants(sweep_no=1):
    """Sweep 1: programs per SM x tile x warps x stages. 2: programs per SM that stay resident (4 warps;
    ``maxnreg`` caps the registers: 2 programs of 4 warps fit at 255, 3 at 168, 4 at 128), row walk ``adv`` 0 (an
    ``if``) or 1 (selects). 3: the nested row loop (``adv`` 2) against sweep 1's best."""
    out = []
    if sweep_no == 5:  # the query loaded every item (flat loop, lockstep)
        for pps, st, qeach in itertools.product((2, 3), (2, 3), (False, True)):
            out.append(dict(pps=pps, block_n=128, warps=4, stages=st, maxnreg=None, adv=0, lock=True, qeach=qeach))
        return out
    if sweep_no == 4:  # the kv heads of a token in lockstep (programs in groups of KVH)
        for pps, bn, st, adv in itertools.product((2, 3), (64, 128), (2, 3), (0, 2)):
            if bn == 128 and pps == 3 and adv == 0:
                continue
            out.append(dict(pps=pps, block_n=bn, warps=4, stages=st, maxnreg=None, adv=adv, lock=True))
        out.append(dict(pps=2, block_n=128, warps=4, stages=3, maxnreg=None, adv=0, lock=False))
        out.append(dict(pps=2, block_n=128, warps=4, stages=2, maxnreg=None, adv=2, lock=False))
        return out
    if sweep_no == 3:
        for pps, bn, st in itertools.product((2, 3, 4), (64, 128), (2, 3)):
            if bn == 128 and pps == 4:
                continue
            out.append(dict(pps=pps, block_n=bn, warps=4, stages=st, maxnreg=None, adv=2))
        out.append(dict(pps=3, block_n=128, warps=4, stages=3, maxnreg=168, adv=2))
        out.append(dict(pps=2, block_n=128, warps=4, stages=3, maxnreg=None, adv=0))
        return out
    if sweep_no == 2:
        for (pps, reg), bn, st, adv in itertools.product(((2, None), (3, 168), (4, 128)), (64, 128), (2, 3), (0, 1)):
            if bn == 128 and pps == 4:  # 4 x 70 KB of shared memory do not fit
                continue
            out.append(dict(pps=pps, block_n=bn, warps=4, stages=st, maxnreg=reg, adv=adv))
        return out
    for pps, bn, w, st in itertools.product((1, 2), (64, 128), (4, 8), (2, 3, 4)):
        if pps * bn * 2 * 128 * st > 200_000 or (bn == 64 and st == 2):
            continue
        out.append(dict(pps=pps, block_n=bn, warps=w, stages=st, maxnreg=None, adv=0))
    return out


def quick(advs=(0, 1, 2), qeach=False) -> int:
    """Interpreted checks against the reference: ragged lengths, rows split across programs (many programs, and
    more programs than items), partial last blocks, block sizes 16 and 32, head sizes 64 and 128, GQA (4 and 3
    query heads per kv head), sequences without query tokens and with two, whole-page reads, both program
    orders; the same bits on a repeat, counters back to zero."""
    bad = 0
    cases = [
        # kv dtypes, q_lens, seq_lens, heads, kv heads, head, block size, block_n, programs
        (["auto", "fp8", "int8_per_token_head", "fp8_per_token_head", "bfloat16"], [1, 1, 1, 1], [1, 5, 40, 70],
         8, 2, 64, 16, 16, (1, 3, 7, 40)),
        (["int8_per_token_head", "fp8"], [1, 0, 2, 1, 1], [9, 3, 33, 70, 16], 6, 2, 128, 32, 32, (5, 11)),
        (["auto", "fp8_per_token_head"], [1] * 6, [100, 17, 64, 1, 31, 50], 4, 4, 64, 32, 16, (4, 9, 64)),
    ]
    for kvs, q_lens, seq_lens, heads, kvh, hd, bs, bn, progs in cases:
        for kv in kvs:
            b = paged_batch(kv, q_lens, seq_lens, heads, kvh, hd, bs, torch.float32, "cpu", seed=len(seq_lens))
            for whole in (False, True):
                want = reference.paged_attention(*b.args(), whole).double()
                for P, rev, adv, lock in itertools.product(progs, (False, True), advs, (False, True)):
                    if lock and P < kvh:
                        continue
                    v = dict(pps=1, block_n=bn, warps=4, stages=2, adv=adv, lock=lock, qeach=qeach)
                    outs = [decode(b, v, whole_page=whole, reverse=rev, programs=P) for _ in range(2)]
                    err = float((outs[0].double() - want).norm() / want.norm())
                    same = torch.equal(outs[0], outs[1])
                    zero = not counters(b.query.device, 1).any()
                    ok = err < 2e-5 and same and zero
                    bad += not ok
                    print(f"{kv:20s} q {q_lens} ctx {seq_lens} {heads}/{kvh}x{hd} bs{bs} bn{bn} P {P:3d} "
                          f"rev {rev:d} adv {adv} lock {lock:d} whole {whole:d}: rel err {err:.1e} same bits {same} "
                          f"counters 0 {zero}"
                          + ("" if ok else "  <-- FAIL"), flush=True)
    print("all ok" if not bad else f"{bad} FAILED")
    return int(bad > 0)


def sweep(dtypes, out_path, reps, jobs, sweep_no=1) -> int:
    """Compile the variants (worker processes), then per dtype time the current paged_attention and every
    variant ``reps`` times round-robin (do_bench, L2 flushed); medians. Block sizes 16 (each dtype) and 32
    (int8_per_token_head)."""
    copy = copy_gbps("cuda")
    vs = variants(sweep_no)
    facts, errors = compile_variants([(kv, vs[i::2]) for kv in dtypes for i in range(2)], decode, ir_facts, jobs)
    rows = []
    for kv, bs in [(kv, 16) for kv in dtypes] + [("int8_per_token_head", 32)]:
        b = paged_batch(kv, [1] * SEQS, [CTX] * SEQS, HEADS, KVH, HD, bs, torch.bfloat16, "cuda", seed=7)
        nbytes = kv_bytes(b)
        want = reference.paged_attention(*b.args()).double()
        cur = attention.paged_attention(*b.args())
        cands = [v for v in vs if (kv, tuple(v.values())) in facts]
        if bs != 16:  # the 4 best of block size 16 (each compiles here, in this process)
            top = sorted((r for r in rows if r["kv"] == kv and r["variant"] != "current"), key=lambda r: -r["x_copy"])
            cands = [r["variant"] for r in top[:4]]
        fns = [("current", None, lambda: attention.paged_attention(*b.args()))]
        for v in cands:
            out = decode(b, v)
            err = float((out.double() - want).norm() / want.norm())
            again = torch.equal(decode(b, v), out)
            zero = not counters(b.query.device, 1).any().item()
            fns.append((v, dict(err=err, same_bits_again=again, counters_zero=zero), lambda v=v: decode(b, v)))
        times = [[] for _ in fns]
        for _ in range(reps):
            for i, (_, _, fn) in enumerate(fns):
                times[i].append(time_ms(fn))
        cur_err = float((cur.double() - want).norm() / want.norm())
        ck = list(attention._ATTN.kernels.values())[-1] if attention._ATTN.kernels else None
        cur_facts = dict(regs=getattr(ck, "n_regs", None), spills=getattr(ck, "n_spills", None),
                         shared_bytes=ck.metadata.shared if ck else None)
        print(f"{kv} bs{bs}: current kernel {cur_facts}", flush=True)
        for (v, chk, _), t in zip(fns, times):
            xs = sorted(nbytes / ms / 1e6 / copy for ms in t)
            f = facts.get((kv, tuple(v.values()))) if v != "current" and bs == 16 else None
            rows.append(dict(kv=kv, block_size=bs, variant=v, x_copy=xs[len(xs) // 2], all=xs,
                             ms=sorted(t)[len(t) // 2], **(chk or dict(err=cur_err)),
                             **(f or (cur_facts if v == "current" else {}))))
        print(f"{kv} bs{bs}: current {rows[-len(fns)]['x_copy']:.3f}", flush=True)
        del b
    if out_path:
        json.dump({"copy_gbps": copy, "reps": reps, "rows": rows, "errors": errors}, open(out_path, "w"), indent=1)
    print(f"copy {copy:.0f} GB/s; x copy, medians of {reps} round-robin")
    keys = sorted({(r["kv"], r["block_size"]) for r in rows}, key=lambda k: (k[1], dtypes.index(k[0])))
    print(f"{'variant':42s} " + " ".join(f"{kv[:12]}/{bs:<3d}" for kv, bs in keys))
    for v in ["current"] + vs:
        cells = []
        for kv, bs in keys:
            r = [r for r in rows if r["kv"] == kv and r["block_size"] == bs and r["variant"] == v]
            cells.append(f"{r[0]['x_copy']:.3f}" + ("" if r[0].get("same_bits_again", True) and r[0]["err"] < 2e-2
                                                   else "!") if r else "  -  ")
        name = v if v == "current" else (f"pps {v['pps']} bn {v['block_n']} w {v['warps']} st {v['stages']}"
                                         + (f" maxnreg {v['maxnreg']}" if v.get("maxnreg") else "")
                                         + (f" adv {v['adv']}" if v.get("adv") else "")
                                         + (" lock" if v.get("lock") else "")
                                         + (" qeach" if v.get("qeach") else ""))
        print(f"{name:42s} " + " ".join(f"{c:16s}" for c in cells))
    for e in errors[:4]:
        print("failed:", e)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="interpreted checks against the reference (CPU)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--adv", default="0,1,2", help="--quick: the row walks to check (0: if, 1: selects, 2: nested)")
    ap.add_argument("--qeach", action="store_true", help="--quick: the query loaded every item")
    ap.add_argument("--sweep", type=int, default=1, help="which variants (see variants())")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    a = ap.parse_args()
    if a.quick:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("run with TRITON_INTERPRET=1")
            return 2
        return quick(tuple(int(x) for x in a.adv.split(",")), a.qeach)
    return sweep(a.dtypes.split(","), a.out, a.reps, a.jobs, a.sweep)


if __name__ == "__main__":
    sys.exit(main())
