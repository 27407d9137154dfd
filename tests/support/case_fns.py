"""Test-only case functions for the runner: healthy, crashing, hanging and raising workers."""

import ctypes
import os
import signal
import time
from pathlib import Path


def healthy(case, ctx):
    return case.result("pass", metrics={"pid": os.getpid(), "value": case.params.get("value")})


def failing(case, ctx):
    rec = case.result("fail")
    rec.add("error", "planted", "a planted failure")
    return rec


def abort(case, ctx):
    print("about to abort", flush=True)
    os.abort()


def cuda_abort(case, ctx):
    """As a vLLM worker after a device fault: the stage mark, CUDA's error line, a C++ terminate, SIGABRT."""
    ctx.stage(case, "lm_eval")
    print("RuntimeError: CUDA error: an illegal memory access was encountered\nterminate called after throwing an "
          "instance of 'c10::Error'", flush=True)
    os.abort()


def dies(case, ctx):
    """As an engine's worker that dies: its stage mark, what the engine printed (``lines``), a module list as long as
    faulthandler's, then the signal named in ``signal`` (faulthandler's own dump and module list follow)."""
    ctx.stage(case, case.params["stage"])
    print(*case.params.get("lines", ()), sep="\n", flush=True)
    modules = ", ".join(f"fake_ext_{i}.core._impl" for i in range(300))
    print(f"Extension modules: {modules} (total: 300)", flush=True)
    os.kill(os.getpid(), getattr(signal, case.params["signal"]))


def segfault(case, ctx):
    print("about to segfault", flush=True)
    ctypes.string_at(0)


def hang(case, ctx):
    print("about to hang", flush=True)
    time.sleep(3600)


def hang_dumping_late(case, ctx):
    """Hangs; its stack dump begins 0.6 s after the runner asks for it (as it did in vLLM cases on the GPU)."""
    import faulthandler

    from kvdiag.death import DUMP_SIGNAL

    def late(signum, frame):
        time.sleep(0.6)
        faulthandler.dump_traceback(all_threads=True)

    faulthandler.unregister(getattr(signal, DUMP_SIGNAL))
    signal.signal(getattr(signal, DUMP_SIGNAL), late)
    print("about to hang", flush=True)
    time.sleep(3600)


def raises(case, ctx):
    raise RuntimeError("planted error in the case")


def exits(case, ctx):
    os._exit(7)


def touch_then_sleep(case, ctx):
    """Marks that it started (a file), then sleeps: lets a test kill kvdiag mid-run."""
    (ctx.run_dir / f"started-{case.params['n']}").touch()
    time.sleep(case.params.get("sleep", 0.0))
    return case.result("pass", metrics={"n": case.params["n"]})


def server_env(case, ctx):
    """What the worker's parent (the fork server, under preload) had in its environment when it started."""
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return case.result("pass", metrics={"server_wait_policy": env.get(b"OMP_WAIT_POLICY", b"").decode()})


def threads(case, ctx):
    import torch

    return case.result("pass", metrics={"omp": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()})


def timed(case, ctx):
    """Sleeps; reports when, where (pid, thread) and with how many torch threads it ran."""
    import threading

    import torch

    start = time.time()
    time.sleep(case.params.get("sleep", 0.0))
    return case.result("pass", metrics={"pid": os.getpid(), "thread": threading.current_thread().name,
                                        "torch": torch.get_num_threads(), "start": start, "end": time.time()})


def no_cache_memory(case, ctx):
    """What vLLM raises when another engine on the GPU took the memory its profiling counted on."""
    raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                     "initializing the engine.")


def gpu_slot(case, ctx):
    """Sleeps; reports when it ran and the GPU it was given (CUDA_VISIBLE_DEVICES), without importing torch.
    ``meet: {"dir": D, "n": N}``: first waits (30 s at most) until N cases have come to D, so that a test knows N
    ran at once whatever the machine's speed; ``met`` says whether they did."""
    start = time.time()
    met = None
    if meet := case.params.get("meet"):
        here = Path(meet["dir"])
        here.mkdir(parents=True, exist_ok=True)
        (here / case.id.replace("/", "_")).touch()
        while len(list(here.iterdir())) < meet["n"] and time.time() < start + 30:
            time.sleep(0.02)
        met = len(list(here.iterdir())) >= meet["n"]
    time.sleep(case.params.get("sleep", 0.0))
    return case.result("pass", metrics={"start": start, "end": time.time(), "met": met,
                                        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")})


def noted(case, ctx):
    """An engine's start that works around something and says so (kvdiag.case.engine_note), then passes."""
    from kvdiag.case import engine_note

    engine_note("planted_note", f"a planted note for {case.id}", value=case.params.get("value"))
    return case.result("pass")


def fires_then_aborts(case, ctx):
    """As a vLLM worker whose re-introduced fault's effect kills it: the fault fires twice (its marks in the log),
    a long traceback pushes the marks out of the log's tail, then SIGABRT."""
    from kvdiag.engines.vllm.faults.patching import fire

    fire("block_tables_not_rebuilt_on_wake")
    fire("block_tables_not_rebuilt_on_wake")
    print("  File \"vllm/v1/worker/gpu/model_runner.py\", line 1, in execute_model\n" * 100, flush=True)
    os.abort()


def fires_then_hangs(case, ctx):
    """As a vLLM worker whose re-introduced fault leaves the engine stuck (a chunked prefill on a GPU): the fault
    fires, then the case never returns."""
    from kvdiag.engines.vllm.faults.patching import fire

    fire("chunk_boundary_token_skipped")
    time.sleep(60)


def probe(seed: int, noise: float = 0.0, n: int = 3, t: int = 5, v: int = 11) -> dict:
    """A drift probe (``kvdiag.checks.sweep.drift.collect``'s shape, full distributions) from numpy alone: the same seed
    gives the same distributions, ``noise`` moves the dtype's logits away from them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    logits = [3 * rng.standard_normal((t, v)) for _ in range(n)]
    moved = np.random.default_rng(seed + 1)
    logits = [x + noise * moved.standard_normal(x.shape) for x in logits]
    dists = [x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in logits]
    return {"over": "full", "dists": dists, "chosen": [[-0.5] * t for _ in range(n)], "greedy": [[1, 2, 3]] * n,
            "greedy_logprobs": [[-0.1] * 3 for _ in range(n)]}


def keeps_then_dies(case, ctx):
    """As an accuracy case whose engine segfaults: its drift probe finishes and is kept (``WorkerContext.keep``),
    then, with ``scores``, lm_eval finishes those tasks and they are kept too; the worker dies in the next stage
    (``lm_eval``, or ``shutdown`` after the tasks); with ``raises``, the case raises there instead."""
    from kvdiag.checks.sweep import drift

    ctx.stage(case, "drift probe")
    path = ctx.artifact(case, drift.DRIFT)
    drift.save(probe(case.params["seed"], case.params.get("noise", 0.0)), path)
    ctx.keep(case, "drift probe", model_dtype="bfloat16", finite=True, drift_over="full",
             timings={"drift": 1.0}, artifacts={"drift": path.name})
    ctx.stage(case, "lm_eval")
    if case.params.get("scores"):
        ctx.keep(case, "lm_eval", scores=case.params["scores"], timings={"lm_eval": 2.0})
        ctx.stage(case, "shutdown")
    if case.params.get("raises"):
        raise RuntimeError("planted error after the drift probe")
    os.kill(os.getpid(), signal.SIGSEGV)


def silent_stage(case, ctx):
    """Enters a stage and says nothing for ``sleep`` seconds (a long engine start), then passes."""
    ctx.stage(case, "engine start")
    time.sleep(case.params.get("sleep", 2.5))
    return case.result("pass")
