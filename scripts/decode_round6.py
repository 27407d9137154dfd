"""Round 6 decode experiment (BENCHMARKS.md, "Round 6"): more programs in flight per SM.

The kept decode kernel runs 32 x 8 = 256 (token, kv head) programs of 4,096 tokens, one split, at 146-156
registers and ~74 KB of shared memory a program: 3 fit per SM, about 2 run per SM, 8 warps. Here: two
splits (512 programs, plus the combine kernel) with registers capped (``maxnreg``) and fewer stages, so
that 4 programs fit per SM and all 512 run in one wave (16 warps per SM). Each variant is the kept
``paged_attention`` with tuning overrides (``num_splits``, ``block_n``, ``num_stages``, ``num_warps``) and
``maxnreg`` added to its launch options; each is checked against the float64 reference and timed as
``kvdiag bench`` times (``do_bench``, L2 flushed), ``--reps`` times round-robin with the kept kernel; the
median × copy is printed per dtype.

    python3 scripts/decode_round6.py --out decode_round6.json          # on the GPU
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kvdiag.kernels import attention
from kvdiag.kernels.bench import copy_gbps, time_ms

from decode_sweep import DTYPES, batch, reference_and_current  # scripts/decode_sweep.py

VARIANTS = [dict(splits=s, block_n=bn, stages=st, warps=w, maxnreg=r)
            for s in (1, 2) for bn in (64, 128) for st in (2, 3) for w in (4,) for r in (None, 128)] + [
    dict(splits=2, block_n=64, stages=2, warps=4, maxnreg=96),
    dict(splits=2, block_n=128, stages=2, warps=8, maxnreg=64),
    dict(splits=4, block_n=64, stages=2, warps=4, maxnreg=96)]


class _WithOptions:
    """attention._ATTN with extra launch options (maxnreg) for the variant being run."""

    def __init__(self, launcher):
        self.launcher, self.extra = launcher, {}

    def __call__(self, grid, args, consts, **options):
        self.launcher(grid, args, consts, **options, **self.extra)


def run_variant(b, v, wrapped):
    wrapped.extra = {} if v["maxnreg"] is None else {"maxnreg": v["maxnreg"]}
    return attention.paged_attention(*b.args(), num_splits=v["splits"], block_n=v["block_n"],
                                     num_stages=v["stages"], num_warps=v["warps"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default=",".join(DTYPES[:3]))
    a = ap.parse_args()
    wrapped = attention._ATTN = _WithOptions(attention._ATTN)
    copy = copy_gbps("cuda")
    out = {"copy_gbps": copy, "dtypes": {}}
    for kv in a.dtypes.split(","):
        b = batch(kv, "cuda", False)
        want, nbytes, cur = reference_and_current(b, copy)
        got = attention.paged_attention(*b.args()).double()
        rows = {"current": dict(x=[cur["x_copy"]], err=float((got - want).abs().max() / want.abs().max()))}
        ok = []
        for v in VARIANTS:
            name = json.dumps(v, sort_keys=True)
            try:
                got = run_variant(b, v, wrapped).double()
            except Exception as e:  # noqa: BLE001 - reported, skipped
                rows[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
                continue
            err = float((got - want).abs().max() / want.abs().max())
            rows[name] = dict(x=[], err=err, finite=bool(torch.isfinite(got).all()))
            if err <= 2 * rows["current"]["err"] and rows[name]["finite"]:
                ok.append((name, v))
        for _ in range(a.reps):
            wrapped.extra = {}
            rows["current"]["x"].append(nbytes / time_ms(lambda: attention.paged_attention(*b.args())) / 1e6 / copy)
            for name, v in ok:
                rows[name]["x"].append(nbytes / time_ms(lambda v=v: run_variant(b, v, wrapped)) / 1e6 / copy)
        regs = {f"{key[1]} {dict(key[2])}": (k.n_regs, k.n_spills, k.metadata.shared)
                for key, k in attention._ATTN.launcher.kernels.items()}
        attention._ATTN.launcher.kernels.clear()
        out["dtypes"][kv] = dict(rows=rows, kernels=regs)
        print(f"== {kv}")
        for name, r in sorted(rows.items(), key=lambda t: -statistics.median(t[1].get("x") or [0])):
            med = statistics.median(r["x"]) if r.get("x") else float("nan")
            print(f"  {med:.3f}  err {r.get('err', 0):.1e}  {name}  {r.get('error', '')}")
        for o, f in regs.items():
            print(f"  kernel {o}: regs {f[0]} spills {f[1]} smem {f[2]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
