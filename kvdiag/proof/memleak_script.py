#!/usr/bin/env python3
"""A leak kvdiag's memleak check found, shown with the engine alone.

In a fresh process: torch and the engine imported (and, on CUDA, the context and cuBLAS warmed) before a baseline of
every tensor the garbage collector sees and of CUDA's allocated bytes; then each cycle as kvdiag ran it: the engine
started with every argument and environment variable kvdiag gave it, the same greedy prompts (as token ids), a
shutdown as kvdiag does it (the engine's shutdown, the engine dropped, ``gc.collect()``, ``torch.cuda.empty_cache()``),
and a census of what is still alive that the baseline did not have. Against what kvdiag saw: the engine's KV cache
itself (its storages, known during the workload), a survivor shaped by the cache (its leading dimension the cache's
blocks or token slots, also behind K/V or the layers), surviving bytes as large as kvdiag's finding, survivors that
grow every cycle, CUDA memory kept, objects left frozen by ``gc.freeze()``, processes the engine started that are
still alive (after the wait kvdiag gave them).

    python3 THIS_FILE            # exit 1: the leak reproduces; 0: it does not; 2: the engine did not run
    python3 THIS_FILE --run 0    # the cycles alone, a JSON line per cycle (what the comparison reads)
# only: vllm

vLLM's shutdown is its engine core's ``shutdown()``, as vLLM's own tests do it. Needs only vLLM (and its torch).
CASE is what kvdiag recorded; edit it to try another configuration.
# only: builtin

The engine is kvdiag's builtin engine, through its public API alone (``kvdiag.engines.builtin``: ``BuiltinEngine``
started from an ``EngineSpec``; its ``kv_blocks`` view of the cache): none of kvdiag's checks, runner or commands.
Needs kvdiag installed, and torch. CASE is what kvdiag recorded; edit it to try another configuration.
# only: end
"""

import gc
import json
import os
import subprocess
import sys
import time

CASE: dict = {}  # filled in by kvdiag: the engine, its prompts and cycles, what kvdiag saw and expects
MARK = "@@reproducer-cycle "
MiB = 1 << 20
SMALL = 4096  # survivors under this are counted, never shown one by one (kvdiag's floor)
SETTLE_S = 2.0  # how long a shut-down engine's last references may take to go (kvdiag waits as long)
TOL = 0.9  # the share of kvdiag's bytes a survivor set must reach (a fresh process sizes a few buffers otherwise)


def cuda():
    import torch

    return torch.cuda.is_available()


def census() -> dict:
    """(device, storage pointer) -> [bytes, [shapes]] of every tensor gc sees, each storage once."""
    import torch

    out = {}
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor):
            continue
        try:
            if o.layout is not torch.strided or o.device.type == "meta":
                continue
            s = o.untyped_storage()
            key = (str(o.device), s.data_ptr())
            row = out.setdefault(key, [s.nbytes(), []])
            row[0] = max(row[0], s.nbytes())
            row[1].append(list(o.shape))
        except Exception:  # noqa: BLE001 - fake or storage-less tensors
            continue
    return out


def children() -> dict:
    """The live processes this process started, at any depth: pid -> command line (Linux's /proc; {} elsewhere)."""
    parents, cmds = {}, {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):  # not a process, or it ended meanwhile
            continue
        if stat[0] != "Z":  # a zombie has ended
            parents[int(d)], cmds[int(d)] = int(stat[1]), cmd[:100]
    out, mine = {}, {os.getpid()}
    while True:
        more = {pid for pid, ppid in parents.items() if ppid in mine and pid not in mine}
        if not more:
            return out
        mine |= more
        out.update((pid, cmds[pid]) for pid in more)


def cleanup() -> None:
    import torch

    gc.collect()
    if cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def started(extra: dict):
    """The engine with kvdiag's arguments and the cycle's own (``extra``: what it changed, ``--kv-sizes``)."""
    # only: vllm
    from vllm import LLM

    return LLM(**{**CASE["engine"]["llm"], **extra})
    # only: builtin
    from kvdiag.engines.builtin import BuiltinEngine, EngineSpec  # the builtin engine's public API

    llm = BuiltinEngine()
    llm.start(EngineSpec(**{**CASE["engine"]["spec"], **extra}))
    return llm
    # only: end


def workload(llm) -> None:
    """The prompts, greedily, in one call."""
    # only: vllm
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=CASE["max_tokens"], temperature=0.0, logprobs=0, **CASE["engine"]["sampling"])
    llm.generate([{"prompt_token_ids": p} for p in CASE["prompts"]], params, use_tqdm=False)
    # only: builtin
    llm.generate(CASE["prompts"], CASE["max_tokens"], greedy=True)
    # only: end


def shut_down(llm) -> None:
    """The engine's shutdown as kvdiag calls it."""
    # only: vllm
    llm.llm_engine.engine_core.shutdown()
    # only: builtin
    llm.shutdown()
    # only: end


def kv_storages(llm) -> tuple[list, int | None]:
    """The KV cache's storages during the workload ((device, pointer, bytes), from the attention and state layers'
    ``kv_cache`` and scale caches, with the engine core in this process) and the cache's blocks; ([], None) where
    they are out of reach."""
    import torch

    # only: builtin
    view = llm.kv_blocks()  # the engine's own view: each layer's K/V and scale caches
    stack = [[layer.k, layer.v, layer.k_scale, layer.v_scale] for layer in view.layers] if view else []
    blocks = view.num_blocks if view else None
    # only: vllm
    try:
        core = llm.llm_engine.engine_core.engine_core
        blocks = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        runner = core.model_executor.driver_worker.worker.model_runner
        layers = list(runner.vllm_config.compilation_config.static_forward_context.values())
    except AttributeError:
        return [], None
    stack = [getattr(m, "kv_cache", None) for m in layers]
    stack += [getattr(getattr(m, "impl", None), n, None) for m in layers for n in ("_k_scale_cache", "_v_scale_cache")]
    # only: end
    found = {}
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.Tensor) and x.numel():
            s = x.untyped_storage()
            found[(str(x.device), s.data_ptr())] = s.nbytes()
    return [[d, p, n] for (d, p), n in found.items()], blocks


def engine_run() -> None:
    """The cycles, in this process: a JSON line per cycle with what survived its shutdown."""
    engine = CASE["engine"]
    os.environ.update(engine["env"])
    import torch

    # only: vllm
    from vllm import LLM, SamplingParams  # noqa: F401 - its modules in the baseline, not in the first cycle's

    # only: builtin
    import kvdiag.engines.builtin.engine  # noqa: F401 - its modules in the baseline, not in the first cycle's survivors
    # only: end
    if cuda():  # what belongs to the process, not the engine: the context and cuBLAS's workspaces
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.ones(64, 64, device="cuda", dtype=dtype)
            (x @ x).sum().item()
        del x
    cleanup()
    base = census()
    base_cuda = torch.cuda.memory_allocated() if cuda() else None
    base_frozen, base_kids = gc.get_freeze_count(), set(children())
    known: set = set()
    for n, extra in enumerate(CASE["cycles"], 1):
        llm = started(extra)
        if n == 1:
            print(MARK + json.dumps({"started": True}), flush=True)
        workload(llm)
        kv, blocks = kv_storages(llm)
        shut_down(llm)
        del llm
        cleanup()
        deadline = time.monotonic() + SETTLE_S
        while True:  # an engine's thread may drop its last references late; a real leak stays
            now = {k: v for k, v in census().items() if k not in base}
            fresh = sum(v[0] for k, v in now.items() if k not in known)
            if fresh < MiB or time.monotonic() > deadline:
                break
            time.sleep(0.25)
            cleanup()
        known |= set(now)
        deadline = time.monotonic() + CASE["expect"].get("processes_wait_s", 0)
        while (kids := {p: c for p, c in children().items() if p not in base_kids}) and time.monotonic() < deadline:
            time.sleep(0.1)  # the engine's processes may take a moment to end (kvdiag waits as long)
        kept = {f"{d} {p}" for d, p, _ in kv} & {f"{d} {p}" for d, p in now}
        geo = CASE["expect"].get("geometry")
        geo = geo and {**geo, "num_blocks": blocks or geo["num_blocks"]}
        print(MARK + json.dumps({
            "cycle": n, "blocks": blocks, "kv_bytes": sum(b for _, _, b in kv), "kv_kept": sorted(kept),
            "kv_kept_bytes": sum(b for d, p, b in kv if f"{d} {p}" in kept),
            "bytes": sum(v[0] for v in now.values()), "count": len(now),
            "large": sorted(([v[0], v[1][0], d] for (d, _), v in now.items() if v[0] >= SMALL), reverse=True),
            "shaped": [[v[0], s, d] for (d, _), v in now.items() for s in v[1][:1] if geo and kv_shaped(s, geo)],
            "cuda_allocated": torch.cuda.memory_allocated() - base_cuda if base_cuda is not None else None,
            "frozen": gc.get_freeze_count() - base_frozen, "processes": kids}),
            flush=True)
        del now
    print(MARK + json.dumps({"done": True}), flush=True)


def in_fresh_process() -> tuple[list, dict, str]:
    proc = subprocess.run([sys.executable, __file__, "--run", "0"], capture_output=True, text=True)
    cycles, end = [], {"exit": proc.returncode}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            said = json.loads(line[len(MARK):])
            (cycles.append(said) if "cycle" in said else end.update(said))
    return cycles, end, "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])


def kv_shaped(shape: list, geo: dict) -> bool:
    """Whether ``shape`` indexes the cache's blocks or token slots along its leading dimensions, also behind a
    leading K/V or layer dimension (kvdiag's rule)."""
    sizes = {geo["num_blocks"], geo["num_blocks"] * geo["block_size"]}
    if len(shape) > 1 and shape[0] in {2, geo["layers"], 2 * geo["layers"]} and shape[1] in sizes:
        return True
    return bool(shape) and shape[0] in sizes


def path(sizes: list) -> str:
    return " → ".join(f"{x / MiB:.3g}" for x in sizes)


def judged(cycles: list) -> list[str]:
    """What reproduces of what kvdiag saw, a line each; [] when nothing does."""
    want, said = CASE["expect"], []
    for c in cycles:
        print(f"  cycle {c['cycle']}: {c['count']} tensor storage(s) the baseline did not have survive shutdown, "
              f"{c['bytes'] / MiB:.3f} MiB" + (f"; CUDA allocated {c['cuda_allocated'] / MiB:+.1f} MiB against the "
                                               "baseline" if c["cuda_allocated"] is not None else ""))
        for nbytes, shape, device in c["large"][:8]:
            print(f"    {nbytes / MiB:10.3f} MiB  {device}  shape {shape}")
    if not cycles:
        return said
    if want.get("kv_cache"):
        hit = [c for c in cycles if c["kv_kept"]]
        print("  the KV cache by identity: kvdiag saw it survive; here "
              + (f"{len(hit[0]['kv_kept'])} of its storages ({hit[0]['kv_kept_bytes'] / MiB:.3f} of "
                 f"{hit[0]['kv_bytes'] / MiB:.3f} MiB) survive cycle {hit[0]['cycle']}" if hit else
                 "none survives" if any(c["blocks"] for c in cycles) else "out of reach (the engine core is not "
                 "in this process)"))
        said += [f"the engine's KV cache survives shutdown (cycle {hit[0]['cycle']})"] if hit else []
    geo = want.get("geometry")
    if geo:
        shaped = max(cycles, key=lambda c: len(c["shaped"]))
        print(f"  shaped by the KV cache ({cycles[0]['blocks'] or geo['num_blocks']} blocks x {geo['block_size']} "
              f"slots, {geo['layers']} layers): kvdiag saw {'some' if want.get('kv_shaped') else 'none'}; here "
              + (f"{len(shaped['shaped'])} after cycle {shaped['cycle']}, e.g. shape {shaped['shaped'][0][1]} "
                 f"({shaped['shaped'][0][0] / MiB:.3g} MiB)" if shaped["shaped"] else "none"))
        said += [f"{len(shaped['shaped'])} survivor(s) shaped by the KV cache (cycle {shaped['cycle']})"] \
            if shaped["shaped"] else []
    if want.get("bytes"):
        worst = max(cycles, key=lambda c: c["bytes"])
        print(f"  surviving bytes: kvdiag saw {want['bytes'] / MiB:.3f} MiB; here at most {worst['bytes'] / MiB:.3f} "
              f"MiB (cycle {worst['cycle']}; reproduced from {TOL:.0%} of kvdiag's)")
        said += [f"{worst['bytes'] / MiB:.3f} MiB survive (cycle {worst['cycle']})"] if \
            worst["bytes"] >= TOL * want["bytes"] else []
    if want.get("grows"):
        sizes = [c["bytes"] for c in cycles]
        grows = len(sizes) > 1 and all(b > a for a, b in zip(sizes, sizes[1:]))
        print(f"  growth: kvdiag saw the survivors grow every cycle ({path(want['grows'])} MiB); here "
              f"{path(sizes)} MiB")
        said += ["the survivors grow every cycle"] if grows and sizes[-1] >= TOL * want["grows"][-1] else []
    if want.get("cuda_allocated") and cycles[0]["cuda_allocated"] is not None:
        worst = max(c["cuda_allocated"] for c in cycles)
        print(f"  CUDA allocated after shutdown: kvdiag saw {want['cuda_allocated'] / MiB:.1f} MiB; here "
              f"{worst / MiB:.1f} MiB")
        said += [f"CUDA keeps {worst / MiB:.1f} MiB"] if worst >= TOL * want["cuda_allocated"] else []
    if want.get("frozen"):
        last = cycles[-1]["frozen"]
        print(f"  gc.freeze() after shutdown: kvdiag saw {want['frozen']} objects stay frozen; here {last} (expected "
              "none: a shutdown undoes what its start froze)")
        said += [f"{last} objects stay frozen by gc.freeze()"] if last > 0 else []
    if want.get("processes"):
        kids = cycles[-1]["processes"]
        print(f"  processes the engine started: kvdiag saw {want['processes']} alive after shutdown; here {len(kids)}"
              f" {want['processes_wait_s']:g} s after it (expected none)")
        for pid, cmd in list(kids.items())[:4]:
            print(f"    pid {pid}  {cmd}")
        said += [f"{len(kids)} process(es) the engine started are alive after shutdown"] if kids else []
    return said


def main() -> int:
    print(f"reproducing: {CASE['title']}\nkvdiag saw: {CASE['kvdiag_saw']}")
    cycles, end, tail = in_fresh_process()
    if not end.get("started"):
        print(f"the engine did not start (exit {end['exit']}); the end of its output:\n{tail}", file=sys.stderr)
        return 2
    said = judged(cycles)
    if not end.get("done"):
        print(f"the engine's process died after {len(cycles)} cycle(s) (exit {end['exit']}):\n{tail}",
              file=sys.stderr)
        if not said:
            return 2
    if said:
        print("REPRODUCED: " + "; ".join(said))
        return 1
    print(f"NOT REPRODUCED: after {len(cycles)} cycle(s) nothing kvdiag saw survives shutdown")
    return 0


if __name__ == "__main__":
    sys.exit(engine_run() or 0 if sys.argv[1:2] == ["--run"] else main())
