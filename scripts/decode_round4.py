"""Round 4 decode experiments (BENCHMARKS.md, "Round 4"): decode without tensor cores (CUDA-core FMA path),
the current kernel's split / tile / warp / stage overrides, int8 codes converted without the subtraction.

The FMA kernel: a GQA group has 4 query heads; round 3's kernel pads them to 16 rows for ``mma.sync`` and
moves the K and V tiles into the dot operands' layouts. Here the K and V tiles stay in the blocked layout
they are loaded in ([1, BLOCK_N, D] tiles, 16-byte loads, each thread one contiguous chunk of a row; loaded
as [BLOCK_N, D] Triton gave the 3-D product another layout), converted in registers, and the products are
broadcasts and reductions over a [G_PAD, BLOCK_N, D] product:

- scores [G_PAD, BLOCK_N] = sum over D of q[:, None, :] * k (in-thread, then the 8 threads of a row),
  online softmax per head;
- ``ACC3`` 0: acc [G_PAD, D] += sum over BLOCK_N of p[:, :, None] * v (a cross-thread and cross-warp
  reduction every tile); 1: an unreduced accumulator [G_PAD, BLOCK_N, D] (acc3 * alpha + p * v,
  elementwise), reduced over BLOCK_N once after the loop;
- ``cvt``: 0 ``.to(float32)``; 1 attention.to_compute's register conversions (fp8 / int8 -> fp16), then
  float32; ``pf``: the next tile loaded into registers before this tile's arithmetic.

Partial results go to attention.py's combine kernel. Each call compiles the variants in worker processes,
then times them and the current ``paged_attention`` with ``triton.testing.do_bench`` (L2 flushed, as
``kvdiag bench``) at 32 seqs x 4096 ctx, 32/8 heads x 128, block size 16. Recorded runs on the H100:
scripts/decode_round4_h100.json (FMA path), decode_round4_current_h100.json (``--current``),
decode_round4_confirm_h100.json and decode_round4_last_h100.json (``--confirm``, the second with
``--variants``; "default" there was 8 splits in the first, 1 split - kept - in the second),
decode_round4_biased_h100.json (``--biased``, with the attention.py of commit 091d34d).

    python3 scripts/decode_round4.py --out decode_round4.json      # on the GPU: the FMA path
    python3 scripts/decode_round4.py --current --dtypes fp8,int8_per_token_head,fp8_per_token_head
    python3 scripts/decode_round4.py --confirm [--variants '[null, {"splits": 1, ...}]']
    python3 scripts/decode_round4.py --quick                        # the FMA kernel against the reference
    python3 scripts/decode_round4.py --ttgir 16,4,1,1,1             # CPU: TTGIR of one variant (sm_90)
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
import triton.language as tl

from kvdiag.kernels import attention, reference
from kvdiag.kernels.attention import _COMBINE, LOG2E, NEG_BIG, S_CHUNK, find_seq, to_compute
from kvdiag.kernels.bench import copy_gbps, kv_bytes, paged_batch, time_ms
from kvdiag.kernels.launch import Launcher, cdiv, next_pow2
from kvdiag.kernels.store import fast_paths, load_scale, quant_params

from decode_sweep import (CTX, DTYPES, HD, HEADS, KVH, SEQS, batch, compile_variants,  # scripts/decode_sweep.py
                          reference_and_current)


@triton.jit
def load_tile(k_cache, v_cache, k_scale_cache, v_scale_cache, block_tables, s, bt_s, kvh, c_b, c_o, c_h, sc_b, sc_o,
              sc_h, start, hi, d, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr):
    """Codes of the K and V rows start .. start + BLOCK_N - 1 as [1, BLOCK_N, D] tiles (the products' layout is
    the loads'), their per-token-head scales (else zeros) and the rows' mask (rows >= hi masked)."""
    offs = start + tl.arange(0, BLOCK_N)
    ld = offs < hi
    page = tl.load(block_tables + s * bt_s + offs // PAGE, mask=ld, other=0).to(tl.int64)
    in_page = offs % PAGE
    kv_off = (page * c_b + in_page * c_o + kvh * c_h)[None, :, None] + d[None, None, :]
    k = tl.load(k_cache + kv_off, mask=ld[None, :, None], other=0.0)
    v = tl.load(v_cache + kv_off, mask=ld[None, :, None], other=0.0)
    if QUANT == 2:
        sc_off = page * sc_b + in_page * sc_o + kvh * sc_h
        ksc = tl.load(k_scale_cache + sc_off, mask=ld, other=0.0)
        vsc = tl.load(v_scale_cache + sc_off, mask=ld, other=0.0)
    else:
        ksc = tl.zeros([BLOCK_N], tl.float32)
        vsc = ksc
    return k, v, ksc, vsc, ld


@triton.jit
def _fma_kernel(q, k_cache, v_cache, k_scale_cache, v_scale_cache, k_scale, v_scale, qsl, seq_lens, block_tables,
                out, part_o, part_ml, sm_scale, num_seqs, s_qt, s_qh, s_ot, s_oh, c_b, c_o, c_h, sc_b, sc_o, sc_h,
                bt_s, split_len,
                G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                QUANT: tl.constexpr, K_PTR: tl.constexpr, V_PTR: tl.constexpr, SPLIT: tl.constexpr,
                FAST: tl.constexpr, ACC3: tl.constexpr, PF: tl.constexpr):
    kvh, t, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = find_seq(qsl, num_seqs, t, 1, 0)
    q_end, ctx = tl.load(qsl + s + 1), tl.load(seq_lens + s)
    pos = ctx - q_end + t
    lo = sp * split_len
    if SPLIT and lo > pos:
        return
    hi = tl.minimum(lo + split_len, pos + 1)
    g = tl.arange(0, G_PAD)
    head = kvh * G + g
    g_ok = g < G
    d = tl.arange(0, D)
    qk_scale = sm_scale * LOG2E
    if QUANT == 1:
        qk_scale = qk_scale * load_scale(k_scale, K_PTR)
    qt = tl.load(q + t.to(tl.int64) * s_qt + head[:, None] * s_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    qt = qt.to(tl.float32) * qk_scale
    m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    if ACC3:
        acc3 = tl.zeros([G_PAD, BLOCK_N, D], tl.float32)
    else:
        acc = tl.zeros([G_PAD, D], tl.float32)
    if PF:  # the next tile's codes and scales are loaded before this tile's arithmetic (register double buffer)
        k, v, ksc, vsc, ld = load_tile(k_cache, v_cache, k_scale_cache, v_scale_cache, block_tables, s, bt_s, kvh,
                                       c_b, c_o, c_h, sc_b, sc_o, sc_h, lo, hi, d, PAGE, BLOCK_N, QUANT)
    for start in range(lo, hi, BLOCK_N):
        if PF:
            k_n, v_n, ksc_n, vsc_n, ld_n = load_tile(k_cache, v_cache, k_scale_cache, v_scale_cache, block_tables, s,
                                                     bt_s, kvh, c_b, c_o, c_h, sc_b, sc_o, sc_h, start + BLOCK_N, hi,
                                                     d, PAGE, BLOCK_N, QUANT)
        else:
            k, v, ksc, vsc, ld = load_tile(k_cache, v_cache, k_scale_cache, v_scale_cache, block_tables, s, bt_s,
                                           kvh, c_b, c_o, c_h, sc_b, sc_o, sc_h, start, hi, d, PAGE, BLOCK_N, QUANT)
        sc = tl.sum(qt[:, None, :] * to_compute(k, tl.float32, FAST).to(tl.float32), 2)  # [G_PAD, BLOCK_N]
        if QUANT == 2:
            sc = sc * ksc[None, :]
        sc = tl.where(ld[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT == 2:
            p = p * vsc[None, :]
        vf = to_compute(v, tl.float32, FAST).to(tl.float32)
        if ACC3:
            acc3 = acc3 * alpha[:, None, None] + p[:, :, None] * vf
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vf, 1)
        m_i = m_new
        if PF:
            k, v, ksc, vsc, ld = k_n, v_n, ksc_n, vsc_n, ld_n
    if ACC3:
        acc = tl.sum(acc3, 1)
    if QUANT == 1:
        acc = acc * load_scale(v_scale, V_PTR)
    if SPLIT:
        num_splits = tl.num_programs(2)
        num_rows = tl.num_programs(1) * tl.num_programs(0) * G
        part = (t.to(tl.int64) * tl.num_programs(0) * G + head) * num_splits + sp
        tl.store(part_o + part[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml + part, m_i, mask=g_ok)
        tl.store(part_ml + num_rows * num_splits + part, l_i, mask=g_ok)
    else:
        o = acc / l_i[:, None]
        tl.store(out + t.to(tl.int64) * s_ot + head[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty),
                 mask=g_ok[:, None])


_FMA = Launcher(_fma_kernel)


def decode(b, v, compile_only=False):
    """Decode attention of batch ``b`` by variant ``v`` (dict: splits, block_n, warps, stages, acc3, cvt, pf)."""
    quant, _ = quant_params(b.kv_dtype)
    query, kc, vc = b.query, b.k_cache, b.v_cache
    n, heads, hd = query.shape
    kvh = kc.shape[2]
    group = heads // kvh
    max_ctx = b.block_tables.shape[1] * kc.shape[1]
    split_len = cdiv(cdiv(max_ctx, v["splits"]), v["block_n"]) * v["block_n"]
    num_splits = cdiv(max_ctx, split_len)
    out = torch.empty_like(query)
    part_o = torch.empty(n, heads, num_splits, hd, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(2, n, heads, num_splits, dtype=torch.float32, device=query.device)
    ksc, vsc, sc, (ks, kp), (vs, vp) = attention.scale_args(quant, kc, vc, *b.args()[8:])
    fast = 0
    if v["cvt"] and fast_paths():
        fast = {torch.int8: 4, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}.get(kc.dtype, 0)
    grid = (kvh, n, num_splits)
    args = (query, kc, vc, ksc, vsc, ks, vs, b.query_start_loc, b.seq_lens, b.block_tables, out, part_o, part_ml,
            float(b.scale), b.seq_lens.shape[0], query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *kc.stride()[:3], *sc[:3], b.block_tables.stride(0), split_len)
    consts = dict(G=group, G_PAD=next_pow2(group), D=hd, PAGE=kc.shape[1], BLOCK_N=v["block_n"], QUANT=quant,
                  K_PTR=kp, V_PTR=vp, SPLIT=num_splits > 1, FAST=fast, ACC3=v["acc3"], PF=v["pf"])
    if compile_only:
        return _fma_kernel[grid](*args, **consts, num_warps=v["warps"], num_stages=v["stages"])
    _FMA(grid, args, consts, num_warps=v["warps"], num_stages=v["stages"])
    if num_splits > 1:
        _COMBINE((n, kvh), (part_o, part_ml, out, b.query_start_loc, b.seq_lens, out.stride(0), out.stride(1),
                            num_splits, n * heads, b.seq_lens.shape[0], split_len),
                 dict(G=group, G4=next_pow2(group), D=hd, D_PAD=hd, S_CHUNK=S_CHUNK, PAGE=kc.shape[1],
                      WHOLE_PAGE=False), num_warps=4)
    return out


def ir_facts(kern) -> dict:
    ir, ptx = kern.asm["ttgir"], kern.asm["ptx"]
    return {"mma_sync": ptx.count("mma.sync"), "shfl": ptx.count("shfl.sync"), "st_shared": ptx.count("st.shared"),
            "ld_shared": ptx.count("ld.shared"), "cp_async": ptx.count("cp.async"), "bar": ptx.count("bar.sync"),
            "convert_layout": ir.count("convert_layout"), "shared_bytes": kern.metadata.shared,
            "regs": getattr(kern, "n_regs", None), "spills": getattr(kern, "n_spills", None)}


def variants(kv=None, quick=False):
    out = []

    def add(sp, bn, w, st, acc3, cvt, pf):
        out.append(dict(splits=sp, block_n=bn, warps=w, stages=st, acc3=acc3, cvt=cvt, pf=pf))

    if quick:
        for acc3, cvt, pf in itertools.product((0, 1), (0, 1), (0, 1)):
            add(3, 16, 4, 1, acc3, cvt, pf)
        return out
    cvts = (0,) if kv == "bfloat16" else (0, 1)
    for (bn, w), sp, cvt, pf in itertools.product(((16, 2), (16, 4), (32, 4), (32, 8)), (8, 16), cvts, (0, 1)):
        add(sp, bn, w, 1, 1, cvt, pf)
    for bn, w, sp, cvt, pf in itertools.product((32, 64, 128), (4, 8), (8, 16), cvts, (0, 1)):
        add(sp, bn, w, 1, 0, cvt, pf)
    return out


def ttgir(spec: str, kv: str) -> str:
    """TTGIR of one variant ("block_n,warps,acc3,cvt,pf") compiled for sm_90 without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bn, w, acc3, cvt, pf = (int(x) for x in spec.split(","))
    quant, _ = quant_params(kv)
    cdt = {"fp8": "fp8e4nv", "int8_per_token_head": "i8", "fp8_per_token_head": "fp8e4nv", "bfloat16": "bf16"}[kv]
    sig = dict(q="*bf16", k_cache="*" + cdt, v_cache="*" + cdt, k_scale_cache="*fp32", v_scale_cache="*fp32",
               k_scale="fp32", v_scale="fp32", qsl="*i32", seq_lens="*i32", block_tables="*i32", out="*bf16",
               part_o="*fp32", part_ml="*fp32", sm_scale="fp32", num_seqs="i32", s_qt="i32", s_qh="i32",
               s_ot="i32", s_oh="i32", c_b="i32", c_o="i32", c_h="i32", sc_b="i32", sc_o="i32", sc_h="i32",
               bt_s="i32", split_len="i32")
    consts = dict(G=4, G_PAD=4, D=128, PAGE=16, BLOCK_N=bn, QUANT=quant, K_PTR=False, V_PTR=False, SPLIT=True,
                  FAST={"fp8": 2, "fp8_per_token_head": 2, "int8_per_token_head": 4}.get(kv, 0) if cvt else 0,
                  ACC3=acc3, PF=pf)
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    div16 = [i for i, n in enumerate(names) if sig[n].startswith("*") or n in ("s_qt", "s_qh", "s_ot", "s_oh", "c_b", "c_o",
                                                                             "c_h", "sc_b", "sc_o", "bt_s", "split_len")]
    src = ASTSource(_fma_kernel, sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in div16})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=w, num_stages=3))
    return k.asm["ttgir"]


def current_variants(kv):
    """Tuning overrides of the current paged_attention (round 3's kernel): fewer splits with deeper pipelines
    (no or less combine work), against the defaults (8 splits, BLOCK_N 128, 4 warps, Triton's stages)."""
    out = []
    for sp, bn, w, st in itertools.product((1, 2, 4, 8), (64, 128), (4, 8), (2, 3, 4)):
        if bn * 2 * 128 * st > 200_000:
            continue
        out.append(dict(splits=sp, block_n=bn, warps=w, stages=st))
    for sp, st in itertools.product((1, 2), (2, 3)):
        out.append(dict(splits=sp, block_n=256, warps=8, stages=st))
    return out


def _run_current(b, v):
    return attention.paged_attention(*b.args(), num_splits=v["splits"], block_n=v["block_n"], num_warps=v["warps"],
                                     num_stages=v["stages"])


def _warm_current(job):
    kv, vs = job
    b = batch(kv, "cuda", False)
    errs = []
    for v in vs:
        try:
            _run_current(b, v)
        except Exception as e:  # noqa: BLE001 - reported; the variant is skipped
            errs.append(dict(kv=kv, **v, error=f"{type(e).__name__}: {e}"[:300]))
    torch.cuda.synchronize()
    return errs


def sweep_current(dtypes, out_path, jobs) -> int:
    copy = copy_gbps("cuda")
    work = [(kv, current_variants(kv)[i::4]) for kv in dtypes for i in range(4)]
    errors = []
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        for e in ex.map(_warm_current, work):
            errors += e
    print(f"compiled; {len(errors)} failed", flush=True)
    bad = {(e["kv"], e["splits"], e["block_n"], e["warps"], e["stages"]) for e in errors}
    rows, current = [], {}
    for kv in dtypes:
        b = batch(kv, "cuda", False)
        want, nbytes, current[kv] = reference_and_current(b, copy)
        for v in current_variants(kv):
            if (kv, *v.values()) in bad:
                continue
            out = _run_current(b, v)
            err = float((out.double() - want).norm() / want.norm())
            ms = time_ms(lambda: _run_current(b, v))
            rows.append(dict(kv=kv, **v, ms=ms, x_copy=nbytes / ms / 1e6 / copy, err=err))
        ms = time_ms(lambda: attention.paged_attention(*b.args()))
        current[kv]["x_copy_after"] = nbytes / ms / 1e6 / copy
        del b
    if out_path:
        json.dump({"copy_gbps": copy, "current": current, "rows": rows, "errors": errors}, open(out_path, "w"),
                  indent=1)
    print("best per dtype and split count:  x copy  (defaults before / after)")
    for kv in dtypes:
        for sp in (1, 2, 4, 8):
            rs = [r for r in rows if r["kv"] == kv and r["splits"] == sp and r["err"] < 2e-2]
            if rs:
                r = max(rs, key=lambda r: r["x_copy"])
                print(f"  {kv:20s} sp {sp} {r['x_copy']:.3f} {r['ms'] * 1e3:.1f} us bn {r['block_n']} w {r['warps']} "
                      f"st {r['stages']} err {r['err']:.1e} ({current[kv]['x_copy']:.3f} / "
                      f"{current[kv]['x_copy_after']:.3f})")
    for e in errors[:4]:
        print("failed:", e)
    return 0


CONFIRM = [None, dict(splits=1, block_n=128, warps=4, stages=2), dict(splits=1, block_n=128, warps=4, stages=3),
           dict(splits=1, block_n=128, warps=4, stages=4), dict(splits=2, block_n=64, warps=4, stages=3),
           dict(splits=2, block_n=128, warps=4, stages=2), dict(splits=4, block_n=128, warps=4, stages=2),
           dict(splits=8, block_n=128, warps=4, stages=2)]


def confirm(dtypes, out_path, reps=5, variants_=None) -> int:
    """The best overrides of the sweep and the defaults (None), timed ``reps`` times round-robin, block sizes 16
    and 32 (median x copy)."""
    copy = copy_gbps("cuda")
    res = []
    for kv, bs in [(kv, 16) for kv in dtypes] + [("int8_per_token_head", 32)]:
        b = paged_batch(kv, [1] * SEQS, [CTX] * SEQS, HEADS, KVH, HD, bs, torch.bfloat16, "cuda", seed=7)
        nbytes = kv_bytes(b)
        vs = variants_ or CONFIRM
        fns = [(lambda: attention.paged_attention(*b.args())) if v is None else (lambda v=v: _run_current(b, v))
               for v in vs]
        times = [[] for _ in vs]
        for _ in range(reps):
            for i, fn in enumerate(fns):
                times[i].append(time_ms(fn))
        for v, t in zip(vs, times):
            xs = sorted(nbytes / ms / 1e6 / copy for ms in t)
            res.append(dict(kv=kv, block_size=bs, variant=v or "default", x_copy=xs[len(xs) // 2], all=xs))
            print(f"  {kv:20s} bs{bs} {str(v or 'default'):62s} median {xs[len(xs) // 2]:.3f} "
                  f"range {xs[0]:.3f}-{xs[-1]:.3f}", flush=True)
        del b
    if out_path:
        json.dump({"copy_gbps": copy, "rows": res}, open(out_path, "w"), indent=1)
    return 0


def biased(out_path, reps=5) -> int:
    """int8 codes converted with and without the subtraction (attention.DECODE_I8_BIASED), defaults and 1 split,
    timed ``reps`` times round-robin (median x copy), with the relative error against the reference. Needs the
    attention.py of commit 091d34d (the switch was reverted with the variant)."""
    if not hasattr(attention, "DECODE_I8_BIASED"):
        print("attention.DECODE_I8_BIASED is gone: check out kernels/attention.py of commit 091d34d")
        return 2
    copy = copy_gbps("cuda")
    res = []
    for bs in (16, 32):
        b = paged_batch("int8_per_token_head", [1] * SEQS, [CTX] * SEQS, HEADS, KVH, HD, bs, torch.bfloat16, "cuda",
                        seed=7)
        nbytes = kv_bytes(b)
        want = reference.paged_attention(*b.args()).double()
        cases = [(v, bias) for v in CONFIRM[:4] for bias in (False, True)]

        def run(v, bias):
            attention.DECODE_I8_BIASED = bias
            return attention.paged_attention(*b.args()) if v is None else _run_current(b, v)

        errs = [float((run(v, bias).double() - want).norm() / want.norm()) for v, bias in cases]
        times = [[] for _ in cases]
        for _ in range(reps):
            for i, (v, bias) in enumerate(cases):
                times[i].append(time_ms(lambda: run(v, bias)))
        for (v, bias), t, err in zip(cases, times, errs):
            xs = sorted(nbytes / ms / 1e6 / copy for ms in t)
            res.append(dict(kv="int8_per_token_head", block_size=bs, variant=v or "default", biased=bias,
                            x_copy=xs[len(xs) // 2], all=xs, err=err))
            print(f"  int8_per_token_head bs{bs} biased {bias!s:5} {str(v or 'default'):62s} median "
                  f"{xs[len(xs) // 2]:.3f} range {xs[0]:.3f}-{xs[-1]:.3f} err {err:.2e}", flush=True)
        del b
    attention.DECODE_I8_BIASED = True
    if out_path:
        json.dump({"copy_gbps": copy, "rows": res}, open(out_path, "w"), indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes, no timing (checks the kernel)")
    ap.add_argument("--ttgir", default=None, help="block_n,warps,acc3,cvt,pf: print that variant's TTGIR (no GPU)")
    ap.add_argument("--current", action="store_true", help="sweep the current kernel's tuning overrides instead")
    ap.add_argument("--confirm", action="store_true", help="re-time the best overrides against the defaults")
    ap.add_argument("--biased", action="store_true", help="int8: conversions with and without the subtraction")
    ap.add_argument("--variants", default=None, help="--confirm: JSON list of override dicts (null: defaults)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    if a.biased:
        return biased(a.out)
    if a.confirm:
        return confirm(dtypes, a.out, variants_=json.loads(a.variants) if a.variants else None)
    if a.current:
        return sweep_current(dtypes, a.out, a.jobs)
    if a.ttgir:
        print(ttgir(a.ttgir, dtypes[0]))
        return 0
    if a.quick:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        bad = 0
        for kv in ["auto", "fp8", "int8_per_token_head", "fp8_per_token_head"]:
            b = batch(kv, dev, True)
            want = reference.paged_attention(*b.args()).double()
            for v in variants(quick=True):
                outs = [decode(b, v) for _ in range(2)]
                err = float((outs[0].double() - want).norm() / want.norm())
                same = torch.equal(outs[0], outs[1])
                bad += err > 1e-4 or not same
                print(kv, v, f"rel err {err:.1e} repeat same bits {same}")
        return int(bad > 0)
    copy = copy_gbps("cuda")
    jobs = [(kv, variants(kv)[i::3]) for kv in dtypes for i in range(3)]
    facts, errors = compile_variants(jobs, decode, ir_facts, a.jobs)
    rows, current = [], {}
    for kv in dtypes:
        b = batch(kv, "cuda", False)
        want, nbytes, current[kv] = reference_and_current(b, copy)
        ms = current[kv]["ms"]
        print(f"{kv}: current kernel {ms * 1e3:.1f} us {current[kv]['x_copy']:.3f} x copy", flush=True)
        for v in variants(kv):
            f = facts.get((kv, tuple(v.values())))
            if f is None:
                continue
            out = decode(b, v)
            err = float((out.double() - want).norm() / want.norm())
            ms = time_ms(lambda: decode(b, v))
            again = torch.equal(decode(b, v), out)
            rows.append(dict(kv=kv, **v, ms=ms, x_copy=nbytes / ms / 1e6 / copy, err=err, same_bits_again=again, **f))
        ms = time_ms(lambda: attention.paged_attention(*b.args()))
        current[kv]["x_copy_after"] = nbytes / ms / 1e6 / copy
        del b
    if a.out:
        json.dump({"copy_gbps": copy, "current": current, "rows": rows, "errors": errors}, open(a.out, "w"), indent=1)
    print("top 5 per dtype:  x copy  (current kernel before / after)")
    for kv in dtypes:
        rs = sorted((r for r in rows if r["kv"] == kv and r["err"] < 2e-2 and r["same_bits_again"]),
                    key=lambda r: -r["x_copy"])
        for r in rs[:5]:
            print(f"  {kv:20s} {r['x_copy']:.3f} {r['ms'] * 1e3:.1f} us bn {r['block_n']} w {r['warps']} st "
                  f"{r['stages']} sp {r['splits']} acc3 {r['acc3']} cvt {r['cvt']} pf {r['pf']} err {r['err']:.1e} shfl "
                  f"{r['shfl']} cvt_layout {r['convert_layout']} regs {r['regs']} spills {r['spills']} "
                  f"({current[kv]['x_copy']:.3f} / {current[kv]['x_copy_after']:.3f})")
    for e in errors[:6]:
        print("failed:", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
