"""How the L2 flush between timed runs changes `kvdiag bench`'s decode and copy numbers.

do_bench flushes L2 by zeroing a 256 MB buffer, which leaves L2 full of dirty lines that are
written back while the timed kernel runs. "clean" flushes the same way, then reads a second
256 MB buffer, so the timed kernel starts with L2 holding clean, unrelated lines.
"""
import json, sys
import torch, triton.testing
from kvdiag.kernels import attention
from kvdiag.kernels.bench import kv_bytes, paged_batch

dev = torch.device("cuda")
dirty = torch.empty(256 << 20, dtype=torch.int8, device=dev)
clean = torch.ones(256 << 18, dtype=torch.float32, device=dev)
sink = torch.empty((), device=dev)


def timed(fn, mode, reps=200):
    fn(); torch.cuda.synchronize()
    if mode == "do_bench":
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        dirty.zero_()
        if mode == "clean":
            torch.sum(clean, dim=0, out=sink)
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2]


out = {}
for nbytes in (1 << 30, 134 << 20):
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
    for mode in ("do_bench", "dirty", "clean"):
        out[f"copy {nbytes >> 20} MiB {mode}"] = 2 * nbytes / timed(lambda: dst.copy_(src), mode) / 1e6
    del src, dst
for d in ("bfloat16", "fp8", "int8_per_token_head", "fp8_per_token_head"):
    b = paged_batch(d, [1] * 32, [4096] * 32, 32, 8, 128, 16, torch.bfloat16, dev)
    nb = kv_bytes(b)
    for mode in ("do_bench", "dirty", "clean"):
        out[f"decode {d} {mode}"] = nb / timed(lambda: attention.paged_attention(*b.args()), mode) / 1e6
json.dump(out, open(sys.argv[1], "w"), indent=1)
c = {m: out[f"copy 1024 MiB {m}"] for m in ("do_bench", "dirty", "clean")}
print(f"{'what':44s} {'GB/s':>7s} {'x copy(same mode, 1GiB)':>10s}")
for k, v in out.items():
    m = k.split()[-1]
    print(f"{k:44s} {v:7.0f} {v / c[m]:10.3f}")
