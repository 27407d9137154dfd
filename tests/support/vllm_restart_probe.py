"""Plain vLLM, no kvdiag: start, request, shut down (as vLLM's tests and kvdiag's VllmEngine do) and start again, in
one process with the engine core in it, printing after each shutdown how many CUDA graphs are still alive and what
the CUDA caching allocator's private pools hold (docs/vllm-findings.md 16: vLLM 0.24's second capture fails when
the first engine's graphs are gone and its graph pool still holds torch's cuBLAS workspace).

    python3 tests/support/vllm_restart_probe.py MODEL [--cycles=N] [key=value ...]   -> ``PROBE {...}`` on stdout

key=value pairs go to ``vllm.LLM`` (kvdiag's explicit KV cache when they size none: tests/support/probes.py ``sized``).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probes import sized  # noqa: E402
from vllm_case_probe import value  # noqa: E402

MiB = 1 << 20


def pools() -> dict:
    """Private pools (CUDA graphs) now: their bytes and the bytes of their blocks in use."""
    import torch

    out = {"pool_mib": 0.0, "pool_active_mib": 0.0}
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0):
            out["pool_mib"] += seg["total_size"] / MiB
            out["pool_active_mib"] += sum(b["size"] for b in seg["blocks"]
                                          if str(b["state"]).startswith("active")) / MiB
    return out


def main(model: str, cycles: int, args: dict) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    rows = []
    for n in range(1, cycles + 1):
        try:
            llm = LLM(model=model, **args)
        except Exception as e:  # noqa: BLE001 - the restart's failure is the probe's answer
            rows.append({"cycle": n, "started": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            break
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        graphs = sum(isinstance(o, torch.cuda.CUDAGraph) for o in gc.get_objects())
        rows.append({"cycle": n, "started": True, "graphs_alive_after_shutdown": graphs,
                     "allocated_mib": torch.cuda.memory_allocated() / MiB, **pools()})
        print("RESTART " + json.dumps(rows[-1]), flush=True)
    return {"model": model, "args": args, "cycles": rows, "restarted": all(r["started"] for r in rows)}


if __name__ == "__main__":
    opts = [a for a in sys.argv[2:] if a.startswith("--cycles=")]
    pairs = dict(a.split("=", 1) for a in sys.argv[2:] if not a.startswith("--"))
    out = main(sys.argv[1], int(opts[0].split("=")[1]) if opts else 3, sized({k: value(v) for k, v in pairs.items()}))
    print("PROBE " + json.dumps(out), flush=True)
    os._exit(0)
