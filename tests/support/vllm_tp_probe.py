"""Plain vLLM, no kvdiag engine: one engine at tensor_parallel_size N (vLLM's MultiprocExecutor, one worker process
per GPU, the engine core in this process) through memleak's or wake-cycle's steps, measured per GPU and per process
with NVML, and inside the workers with ``collective_rpc``; one line ``PROBE {json}`` (tests/support/probes.py).

    python3 tests/support/vllm_tp_probe.py memleak [--tp 2] [--model M] [--kv-dtype D]
    python3 tests/support/vllm_tp_probe.py wake --level 1|2 [--tp 2] [--model M] [--kv-dtype D]
    python3 tests/support/vllm_tp_probe.py memleak --in-child 150   # in a forkserver child, as kvdiag's cases run

memleak: NVML's used memory and compute processes per GPU before the start, with the engine up, and 3 s after
shutdown as vLLM's tests do it (``engine_core.shutdown()``, ``del llm``, ``gc.collect()``); each worker's pid and KV
cache bytes from inside it; which worker pids are still alive after shutdown.
wake: greedy tokens before a sleep at the level and after vLLM's documented wake (level 2: weights,
``reload_weights``, kv_cache), and each GPU's used memory awake, asleep and woken.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kvdiag.models, from this checkout

PROMPTS = ["The capital of France is", "k01=123; k02=456; k01=", "Once upon a time", "0 1 2 3 4 5"]
MiB = 1 << 20


def gpus() -> list[dict]:
    """Per GPU: NVML's used MiB and its compute processes {pid: MiB}."""
    import pynvml

    pynvml.nvmlInit()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        procs = {p.pid: round((p.usedGpuMemory or 0) / MiB, 1) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        out.append({"used_mib": round(pynvml.nvmlDeviceGetMemoryInfo(h).used / MiB, 1), "procs": procs})
    return out


def worker_kv(worker) -> dict:
    """Runs in each worker (collective_rpc): its pid, GPU, rank and KV cache tensors' bytes."""
    import torch

    runner = worker.model_runner
    seen = {}
    for t in getattr(runner, "kv_caches", []) or []:
        for x in t if isinstance(t, (list, tuple)) else [t]:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return {"pid": os.getpid(), "device": torch.cuda.current_device(), "kv_mib": round(sum(seen.values()) / MiB, 2),
            "kv_storages": len(seen)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("memleak", "wake"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: kvdiag's shipped tiny model")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--level", type=int, choices=(1, 2), default=1)
    ap.add_argument("--in-child", type=float, default=0, metavar="S",
                    help="run in a forkserver child, as kvdiag runs a case; a child not done in S seconds dumps its "
                         "stacks and the probe says it hung")
    a = ap.parse_args()
    if a.in_child:
        import multiprocessing as mp

        child = mp.get_context("forkserver").Process(target=_child, args=(a,))
        child.start()
        child.join(a.in_child + 10)
        if child.is_alive():
            child.kill()
            print("PROBE " + json.dumps({"mode": a.mode, "tp": a.tp, "hung": True, "after_s": a.in_child}), flush=True)
        return
    probe(a)


def _child(a) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(a.in_child, exit=True)
    probe(a)
    sys.stdout.flush()
    os._exit(0)


def probe(a) -> None:
    from vllm import LLM

    from kvdiag.assets import TINY_MODEL
    from kvdiag.models import resolve

    model, t0 = resolve(a.model or str(TINY_MODEL)), time.time()
    res: dict = {"mode": a.mode, "tp": a.tp, "kv_dtype": a.kv_dtype, "before": gpus()}
    llm = LLM(model=model, tensor_parallel_size=a.tp, kv_cache_dtype=a.kv_dtype, enforce_eager=True, seed=0,
              max_model_len=512, kv_cache_memory_bytes=256 * MiB, enable_sleep_mode=a.mode == "wake")
    res["start_s"] = round(time.time() - t0, 1)
    res["workers"] = llm.collective_rpc(worker_kv)
    tokens = generate(llm)
    res["up"] = gpus()
    if a.mode == "memleak":
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        time.sleep(3)
        res["after"] = gpus()
        res["alive_after_shutdown"] = [w["pid"] for w in res["workers"] if alive(w["pid"])]
    else:
        llm.sleep(level=a.level)
        res["asleep"] = gpus()
        if a.level == 2:
            llm.wake_up(tags=["weights"])
            llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
        else:
            llm.wake_up()
        res["woken"] = gpus()
        again = generate(llm)
        res["tokens_equal"] = again == tokens
        res["differing_prompts"] = [i for i, (x, y) in enumerate(zip(tokens, again)) if x != y]
    res["seconds"] = round(time.time() - t0, 1)
    print("PROBE " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's atexit teardown
