"""`kvdiag bench`: every measurement of a run (kernel rows, engine rows) on one device, and the targets judged on
them (BENCHMARKS.md, "Targets")."""

from __future__ import annotations

import torch

from kvdiag.bench.measure import copy_gbps

KINDS = ("store", "decode", "prefill", "zero", "engine")
# (what, row filter, value of a row, at least): the targets (BENCHMARKS.md, "Targets")
TARGETS = [
    ("store >= 90% of copy bandwidth", lambda r: r["kernel"] == "store", lambda r: r["vs_copy"], 0.90),
    ("decode >= 75% of copy bandwidth",
     lambda r: r["kernel"] == "decode" and r["kv_dtype"] in ("bfloat16", "fp8", "int8_per_token_head"),
     lambda r: r["vs_copy"], 0.75),
    ("decode >= 2x the SDPA baseline",
     lambda r: r["kernel"] == "decode" and r["kv_dtype"] in ("bfloat16", "fp8", "int8_per_token_head"),
     lambda r: r["baselines"]["sdpa"]["speedup"], 2.0),
    ("zero >= 80% of copy bandwidth", lambda r: r["kernel"] == "zero", lambda r: r["vs_copy"], 0.80),
    ("engine decode at batch 32 >= 3x transformers", lambda r: r["kernel"] == "engine" and r["batch"] == 32,
     lambda r: r["speedup"], 3.0),
]


def judge(rows: list[dict]) -> list[dict]:
    """Each target against each row it applies to."""
    out = []
    for what, applies, value, least in TARGETS:
        for r in filter(applies, rows):
            v = value(r)
            out.append({"target": what, "kernel": r["kernel"], "kv_dtype": r.get("kv_dtype", ""),
                        "size": r.get("size", f"batch {r.get('batch')}"), "value": v, "threshold": least,
                        "met": v >= least})
    return out


def run_bench(kinds=KINDS, size: str = "full", device="cuda", progress=None) -> dict:
    """Measure everything in ``kinds`` at ``size`` (see kernel_rows.SHAPES); ``progress(msg)`` is called
    before each row. Targets are judged on full-size runs only."""
    import triton

    from kvdiag.bench.engine_rows import engine_rows
    from kvdiag.bench.kernel_rows import kernel_rows
    from kvdiag.engines.builtin import cuda_graph
    from kvdiag.kernels.launch import direct_launch
    from kvdiag.kernels.store import fast_paths

    device = torch.device(device)
    cuda = device.type == "cuda"
    copy = copy_gbps(device, {"full": 1024 << 20, "quick": 256 << 20}.get(size, 1 << 20))
    rows = []
    for i, measure in enumerate(kernel_rows(kinds, device, copy, size)):
        if progress:
            progress(f"kernel row {i + 1}")
        rows.append(measure().to_json())
        if cuda:
            torch.cuda.empty_cache()
    if "engine" in kinds:
        if progress:
            progress("engine rows (builtin vs transformers generate)")
        rows += engine_rows(device, tiny=size == "tiny", new_tokens=128 if size == "full" else 8)
    env = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "fast_paths": fast_paths(), "direct_launch": direct_launch(),
           "cuda_graphs": cuda_graph.enabled(None, device)}
    return {"environment": env, "size": size, "copy_gbps": copy, "rows": rows,
            "targets": judge(rows) if size == "full" else []}
