"""Plain vLLM, no kvdiag: what vLLM really does in kvdiag's process layout (the engine core in this process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), measured directly. tests/gpu/test_vllm_gpu.py compares kvdiag's verdicts with
what this prints.  ``python3 tests/support/vllm_gpu_probe.py sleep|eager MODEL``  -> one JSON line on stdout.

- ``sleep``: an engine with sleep mode; greedy outputs; level-2 sleep and vLLM's documented wake (weights,
  ``reload_weights``, kv_cache): outputs again; then kvdiag's old level-2 wake (weights, reload, every tag);
  shutdown as vLLM's tests do:
  GPU memory still used beyond the start; then a second engine with sleep mode in the same process.
- ``eager [--cycles=N] [key=value ...]``: three (N) start / generate / shutdown cycles without sleep mode: CUDA
  allocated and the driver's used memory after each shutdown, and the cycles' time (``case_work_s``: the oracle for
  "a memleak case costs at most 1.3x the plain script"); engine arguments given replace the defaults' (kvdiag's
  explicit KV cache; ``enforce_eager=false`` for vLLM's compiled mode); also how many of torch.compile's bytecode
  hooks stay registered after each shutdown and whether the ``LLMEngine`` (whose finalizer removes its own) was
  collected.
- ``defaults``: the same with vLLM's defaults (torch.compile, CUDA graphs captured on a new stream each start),
  then torch's cuBLAS workspaces (one per cuBLAS handle and stream) cleared: what that gives back.
- ``wake LEVEL CYCLES [key=value ...]``: what one ``kvdiag wake-cycle -e vllm -l LEVEL -n CYCLES`` case does, with
  the engine arguments given (kvdiag's explicit KV cache): an engine with sleep mode, greedy outputs of kvdiag's
  prompts, then CYCLES times sleep(LEVEL), vLLM's wake (level 2: weights, ``reload_weights``, kv_cache) and the
  outputs again; each phase timed (the oracle for "a wake-cycle case costs at most 1.3x the plain script").
- ``mp``: two cycles with ``distributed_executor_backend="mp"``, the engine's worker in a process of its own (as
  with ``tensor_parallel_size > 1``): with psutil and NVML alone, the worker processes and the GPU memory of this
  process and its children during the workload and 10 s after shutdown, and the device's used memory.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import weakref

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "key 7 maps to"]
ARGS = {"enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 512, "seed": 0}
MiB = 1 << 20


def used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def cleanup() -> None:
    """After ``llm.llm_engine.engine_core.shutdown()`` and ``del llm`` in the caller's frame (no reference left)."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:300]


def sleep_probe(model: str) -> dict:
    import torch
    from vllm import LLM

    torch.zeros(1, device="cuda")
    base = used()
    llm = LLM(model=model, enable_sleep_mode=True, **ARGS)
    ref = greedy(llm)
    awake = used()
    llm.sleep(level=2)
    asleep = used()
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    out = {"identical_after_level2": greedy(llm) == ref, "awake_mib": (awake - base) / MiB,
           "asleep_mib": (asleep - base) / MiB}
    llm.sleep(level=2)  # kvdiag's old sequence: the weights, the reload, then every tag (the weights again)
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    try:
        llm.wake_up()
        out["old_wake_all_after_weights"] = "no error"
    except Exception as e:  # noqa: BLE001 - what vLLM says is the probe's result
        out["old_wake_all_after_weights"] = first_line(e)
        llm.wake_up(tags=["kv_cache"])  # the failed call stopped at the weights: map the cache back before shutdown
    llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup()
    out["held_after_shutdown_mib"] = (used() - base) / MiB
    try:
        LLM(model=model, enable_sleep_mode=True, **ARGS)
        out["second_start"] = "started"
    except Exception as e:  # noqa: BLE001
        out["second_start"] = first_line(e)
    return out


def eager_probe(model: str, eager: bool = True, cycles: int = 3, **engine) -> dict:
    import time

    t0 = time.perf_counter()
    import torch
    from vllm import LLM

    t1 = time.perf_counter()

    start = torch.cuda.memory_allocated()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # as kvdiag's baseline: cuBLAS's handle and
        x = torch.ones(64, 64, device="cuda", dtype=dtype)  # workspaces belong to the process, not the engine
        (x @ x).sum().item()
    del x
    base_alloc, base_used = torch.cuda.memory_allocated(), used()
    alloc, drv, hooks, engines_alive = [], [], [], []
    for _ in range(cycles):
        llm = LLM(model=model, **{**ARGS, "enforce_eager": eager, **engine})
        greedy(llm)
        engine_ref = weakref.ref(llm.llm_engine)
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup()
        alloc.append((torch.cuda.memory_allocated() - base_alloc) / MiB)
        drv.append((used() - base_used) / MiB)
        hooks.append(len(getattr(torch._dynamo.convert_frame, "_bytecode_hooks", ())))
        engines_alive.append(engine_ref() is not None)
    out = {"allocated_after_shutdown_mib": alloc, "driver_used_after_shutdown_mib": drv,
           "dynamo_bytecode_hooks_after_shutdown": hooks, "llm_engine_alive_after_shutdown": engines_alive,
           "baseline_cublas_workspace_mib": (base_alloc - start) / MiB, "import_s": round(t1 - t0, 2),
           "case_work_s": round(time.perf_counter() - t1, 2)}
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    out["allocated_after_clearing_cublas_workspaces_mib"] = (torch.cuda.memory_allocated() - base_alloc) / MiB
    return out


def wake_probe(model: str) -> dict:
    import time

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    from kvdiag.checks.greedy import prompt_texts
    from kvdiag.checks.wake_cycle.params import MAX_TOKENS

    level, cycles = int(sys.argv[3]), int(sys.argv[4])
    args = engine_args(sys.argv[5:])
    prompts, params = prompt_texts(model, None), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    t1 = time.perf_counter()
    llm = LLM(model=model, enable_sleep_mode=True, seed=0, **args)
    t2 = time.perf_counter()

    def outputs():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    ref, same = outputs(), []
    for _ in range(cycles):
        sleep_and_wake(llm, level)
        same.append(outputs() == ref)
    t3 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    t4 = time.perf_counter()
    return {"level": level, "cycles": cycles, "identical": same, "import_s": round(t1 - t0, 2),
            "engine_start_s": round(t2 - t1, 2), "cycles_s": round(t3 - t2, 2), "shutdown_s": round(t4 - t3, 2),
            "case_work_s": round(t4 - t1, 2)}


def engine_args(pairs: list[str]) -> dict:
    """``key=value`` words as vLLM's engine arguments, parsed as the other probes parse them."""
    from vllm_case_probe import value

    return {k: value(v) for k, v in (a.split("=", 1) for a in pairs)}


def sleep_and_wake(llm, level: int) -> None:
    """``sleep(level)`` and vLLM's documented wake: level 2 wakes the weights, re-reads them from the checkpoint
    (``reload_weights``), then wakes the KV cache; level 1 wakes everything."""
    llm.sleep(level=level)
    if level == 2:
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
    else:
        llm.wake_up()


def tree_gpu() -> dict:
    """This process's children and NVML's memory of this process and its children, on every GPU."""
    import psutil
    import pynvml

    kids = [p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    mine, pids = {os.getpid(), *kids}, []
    pynvml.nvmlInit()
    try:
        total = used_all = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            used_all += pynvml.nvmlDeviceGetMemoryInfo(h).used
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                pids.append(p.pid)
                total += (p.usedGpuMemory or 0) if p.pid in mine else 0
    finally:
        pynvml.nvmlShutdown()
    return {"children": len(kids), "tree_mib": total / MiB, "device_used_mib": used_all / MiB,
            "nvml_pids_ours": bool(mine & set(pids)), "nvml_processes": len(pids)}


def mp_probe(model: str) -> dict:
    import time

    import torch
    from vllm import LLM

    torch.zeros(1, device="cuda")
    out = {"baseline": tree_gpu(), "workload": [], "after_shutdown": []}
    for _ in range(2):
        llm = LLM(model=model, distributed_executor_backend="mp", **ARGS)
        greedy(llm)
        out["workload"].append(tree_gpu())
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup()
        time.sleep(10)
        out["after_shutdown"].append(tree_gpu())
    return out


if __name__ == "__main__":
    mode, model = sys.argv[1], sys.argv[2]
    probes = {"sleep": sleep_probe, "eager": eager_probe, "defaults": lambda m: eager_probe(m, eager=False),
              "mp": mp_probe, "wake": wake_probe}
    if mode == "eager" and sys.argv[3:]:  # engine arguments given: the cycles of one kvdiag memleak case
        n = [int(a.split("=", 1)[1]) for a in sys.argv[3:] if a.startswith("--cycles=")]
        result = eager_probe(model, cycles=n[0] if n else 3,
                             **engine_args([a for a in sys.argv[3:] if not a.startswith("--")]))
    else:
        result = probes[mode](model)
    print("PROBE " + json.dumps(result), flush=True)
    os._exit(0)  # vLLM's sleep-mode allocator may not let the interpreter exit cleanly
