#!/usr/bin/env python3
"""A failure kvdiag's wake-cycle or poison check found, shown with the engine alone.

One engine starts in a fresh process with every argument and environment variable kvdiag gave it and runs the steps
below as kvdiag did: greedy generate calls (the prompts as token ids), and between them what the check did to the
engine: a sleep and the engine's wake (wake-cycle), or the free KV blocks filled with poison or zeros before each
wave (poison: the blocks no request holds, filled in every cache tensor indexed by block; where kvdiag found NaN/Inf
in the KV slots a wave wrote, each poisoned wave's written slots are scanned after it).
Each later run is then held to its reference run as kvdiag holds it: every greedy token the same, each logprob within
the tolerance, none NaN or inf; where the case judged memory, the bytes a sleep freed (CUDA's driver view) against
those kvdiag expected, and what a wake brought back.

    python3 THIS_FILE            # exit 1: the failure reproduces; 0: it does not; 2: the engine did not run
    python3 THIS_FILE --run 0    # the engine's steps alone, a JSON line per step (what the comparison reads)
# only: vllm

vLLM's wake is the one it documents; its free blocks are read from its own block pool and its cache tensors from the
attention and state layers, which needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as kvdiag
runs it). Needs only vLLM (and its torch). CASE is what kvdiag recorded; edit it to try another configuration.
# only: builtin

The engine is kvdiag's builtin engine, through its public API alone (``kvdiag.engines.builtin``: ``BuiltinEngine``
started from an ``EngineSpec``; its ``sleep``, ``wake_up`` and ``kv_blocks`` view of the cache): none of kvdiag's
checks, runner or commands. Needs kvdiag installed, and torch. CASE is what kvdiag recorded; edit it to try another
configuration.
# only: end
"""

import json
import math
import os
import subprocess
import sys

CASE: dict = {}  # filled in by kvdiag: the engine, its inputs and steps, the comparisons, what kvdiag saw
MARK = "@@reproducer-step "
MiB = 1 << 20


def used_memory():
    """Bytes in use on the current GPU as the driver sees them (a sleep may unmap memory under live tensors: only
    the driver sees it go); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def cache(llm) -> tuple:
    """(the blocks no request holds, the tokens a block holds, every cache tensor indexed by block)."""
    # only: vllm
    import torch

    # vLLM's block pool and model runner, from the engine core in this process (AttributeError where it is in
    # another): attention K/V and scales, Mamba states
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    runner = core.model_executor.driver_worker.worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context.values()
    tensors, seen = [], set()
    stack = [getattr(m, "kv_cache", None) for m in layers]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == pool.num_gpu_blocks and id(x) not in seen:
            seen.add(id(x))
            tensors.append(x)
    free = [b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash is None]
    # the tokens an attention page holds: its group's (a hybrid's attention blocks are not cache_config's size)
    sizes = {g.kv_cache_spec.block_size for g in core.scheduler.kv_cache_config.kv_cache_groups
             if "Mamba" not in type(g.kv_cache_spec).__name__}
    return free, sizes.pop() if len(sizes) == 1 else runner.vllm_config.cache_config.block_size, tensors
    # only: builtin
    view = llm.kv_blocks()  # the engine's own view: each layer's K/V and scale caches, [num_blocks, block_size, ...]
    tensors = [t for layer in view.layers for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
    return list(view.free_blocks()), view.block_size, tensors
    # only: end


_SNAP: list = []  # (tensor, its copy) of every attention K/V tensor right after a fill that a scan compares with


def scanned(llm) -> tuple[list, list]:
    """(the attention layers' cache tensors a scan reads, the blocks last handed to a state group: not K/V)."""
    # only: vllm
    layers = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner \
        .vllm_config.compilation_config.static_forward_context.values()
    attention = {id(t) for m in layers if hasattr(m, "impl") for t in _tensors(getattr(m, "kv_cache", None))}
    return [t for t in cache(llm)[2] if id(t) in attention], state_blocks(llm)
    # only: builtin
    return cache(llm)[2], []  # the builtin engine's view holds attention layers alone
    # only: end


# only: vllm
_OWNERS: dict = {}  # {block id: the KV cache group it was last handed to}, recorded from the first scan's snapshot on


class _OwnedPool:
    """One KV cache group's handle on vLLM's shared block pool (a hybrid's groups overlay one pool): hands out blocks
    as the pool does, and records the group, so that a scan reads a block a state group wrote as states, not K/V."""

    def __init__(self, pool, group: int):
        self.__dict__.update(_pool=pool, _group=group)

    def get_new_blocks(self, num_blocks: int):
        blocks = self._pool.get_new_blocks(num_blocks)
        _OWNERS.update((b.block_id, self._group) for b in blocks)
        return blocks

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def __setattr__(self, name, value):
        setattr(self._pool, name, value)


def state_blocks(llm) -> list[int]:
    """The blocks last handed to a group of Mamba states (none but on a hybrid), tracked from the first call on."""
    managers = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers
    for gid, m in enumerate(managers):
        if not isinstance(m.block_pool, _OwnedPool):
            m.block_pool = _OwnedPool(m.block_pool, gid)
    states = {gid for gid, m in enumerate(managers) if "Mamba" in type(m.kv_cache_spec).__name__}
    return [b for b, g in _OWNERS.items() if g in states]


def _tensors(x) -> list:
    return [t for y in x for t in _tensors(y)] if isinstance(x, (list, tuple)) else [x] if x is not None else []
# only: end


def snapshot(llm) -> None:
    import torch

    tensors, _ = scanned(llm)  # from here on, which KV cache group each block goes to (a hybrid)
    with torch.inference_mode():
        _SNAP[:] = [(t, t.clone()) for t in tensors]


def scan_written(llm) -> dict:
    """The KV slots the last wave wrote (any byte changed since the fill's snapshot), and how many of them hold a
    NaN or Inf, as kvdiag scans them: a slot is one token's place in a block of an attention layer, read along the
    tensor's axis of the block's slots (a tensor without one is not scanned; nor, on a hybrid, a block last handed
    to a state group); fp8 caches read as the fp8 they store."""
    import torch

    block_size = cache(llm)[1]
    fp8 = torch.float8_e5m2 if "e5m2" in CASE["kv_cache_dtype"] else torch.float8_e4m3fn
    written = bad = 0
    states = torch.as_tensor(scanned(llm)[1], dtype=torch.long)
    for t, before in _SNAP:
        axis = next((i for i in (1, 2) if t.dim() > i and t.shape[i] == block_size), None)
        if axis is None or t.dtype == torch.int8:  # no slots to read, or int8 codes (no NaN code)
            continue

        def slots(x):
            return x.movedim(axis, 1).reshape(t.shape[0], block_size, -1)

        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]  # NaN != NaN
        changed = slots(t.view(bits)).ne(slots(before.view(bits))).any(-1)
        changed[states.to(changed.device)] = False  # a state group's block: its bytes are states, not K/V
        values = slots(t.view(fp8) if t.element_size() == 1 else t).float()
        nonfinite = (~values.isfinite()).any(-1)
        written += int(changed.sum())
        bad += int((changed & nonfinite).sum())
    _SNAP.clear()
    return {"written": written, "nonfinite": bad}


def fill_free_blocks(llm, value: str, seed: int) -> int:
    """Fill every block no request holds in every cache tensor indexed by block (``cache``): ``random`` with seeded
    bits, else with ``CASE["fill"][value]``'s number for the tensor's dtype as kvdiag fills it (1-byte codes, fp8
    stored as uint8 and int8: the code's bits). Returns the blocks filled."""
    import torch

    free, _, tensors = cache(llm)
    if not free or not tensors:
        return 0
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():  # an engine may make cache tensors inside it; they refuse writes outside
        for t in tensors:
            idx = torch.as_tensor(free, dtype=torch.long, device=t.device)
            if value == "random":
                for b in free:
                    bits = torch.randint(0, 256, (t[b].numel() * t.element_size(),), generator=g, dtype=torch.uint8)
                    t[b].copy_(bits.view(t.dtype).view(t[b].shape).to(t.device))
            elif t.element_size() == 1:  # index_fill_ has no fp8 kernels: the code's bits
                t.view(torch.uint8).index_fill_(0, idx, CASE["fill"][value][str(t.dtype).split(".")[-1]])
            else:
                t.index_fill_(0, idx, float(CASE["fill"][value][str(t.dtype).split(".")[-1]]))
    return len(free)


def step_once(llm, step: dict):
    """One step in the engine's process; what it gives the comparison (outputs, bytes, blocks) or None."""
    do = step["do"]
    if do == "generate":
        prompts = CASE["inputs"][step["prompts"]]  # token ids, named once: several steps run the same prompts
        # only: vllm
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=step["max_tokens"], temperature=0.0, logprobs=0,
                                **CASE["engine"]["sampling"])
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [{"token_ids": list(r.outputs[0].token_ids),
                 "logprobs": [pos[t].logprob for t, pos in zip(r.outputs[0].token_ids, r.outputs[0].logprobs or [])]}
                for r in results]
        # only: builtin
        return [{"token_ids": list(c.token_ids), "logprobs": list(c.logprobs)}
                for c in llm.generate(prompts, step["max_tokens"], greedy=True)]
        # only: end
    if do == "sleep":
        llm.sleep(level=step["level"])
    elif do == "wake":
        llm.wake_up(tags=step["tags"])
    # only: vllm
    elif do == "reload_weights":  # level 2 discarded the weights: read them again from the checkpoint
        llm.collective_rpc("reload_weights")
    # only: end
    elif do == "scan":
        return scan_written(llm)
    elif do == "fill":
        try:
            filled = fill_free_blocks(llm, step["value"], step.get("seed", 0))
            if step.get("snapshot"):  # a scan after the wave finds the slots it wrote against this
                snapshot(llm)
            return filled
        except Exception:  # noqa: BLE001 - e.g. the engine core in another process (tensor parallel)
            if step.get("optional"):  # wake-cycle's scrub: the wake is what is shown, with or without it
                return None
            raise
    elif do == "memory":
        return used_memory()
    return None


def engine_run() -> None:
    """The steps, in this process: a JSON line per step that has a label, then ``done``; an exception after the
    engine started is reported as the step's error (the engine's own failure)."""
    engine = CASE["engine"]
    os.environ.update(engine["env"])
    # only: vllm
    from vllm import LLM

    llm = LLM(**engine["llm"])
    # only: builtin
    from kvdiag.engines.builtin import BuiltinEngine, EngineSpec  # the builtin engine's public API

    llm = BuiltinEngine()
    llm.start(EngineSpec(**engine["spec"]))
    # only: end
    print(MARK + json.dumps({"started": True}), flush=True)
    for step in CASE["steps"]:
        try:
            got = step_once(llm, step)
        except Exception as e:  # noqa: BLE001 - the engine's failure is what the comparison reads
            what = f"{step.get('what', step['do'])}: {type(e).__name__}: {e}"
            # a fill that fails is this script's own failure (it cannot reach the blocks), not the engine's
            print(MARK + json.dumps({"error": what[:600], "ours": step["do"] == "fill"}), flush=True)
            return
        if step.get("as"):
            print(MARK + json.dumps({"as": step["as"], "got": got}), flush=True)
    print(MARK + json.dumps({"done": True}), flush=True)


def in_fresh_process() -> tuple[dict, dict, str]:
    """The engine's steps in a fresh process: (what each labelled step gave, how it ended, the end of its output)."""
    proc = subprocess.run([sys.executable, __file__, "--run", "0"], capture_output=True, text=True)
    got, end = {}, {"exit": proc.returncode}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            said = json.loads(line[len(MARK):])
            if "as" in said:
                got[said["as"]] = said["got"]
            else:
                end.update(said)
    return got, end, "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])


def held(ref: list, out: list, tol: float) -> list[str]:
    """Where ``out`` breaks the rule against ``ref``, request by request: [] when it holds."""
    said = []
    for r, (a, b) in enumerate(zip(ref, out)):
        x, y = a["token_ids"], b["token_ids"]
        pos = next((i for i in range(max(len(x), len(y))) if i >= min(len(x), len(y)) or x[i] != y[i]), None)
        moved = [abs(u - v) for u, v in zip(a["logprobs"][:pos], b["logprobs"][:pos])]
        worst = max(moved, default=0.0, key=lambda d: math.inf if math.isnan(d) else d)
        bad = [i for i, lp in enumerate(b["logprobs"]) if not math.isfinite(lp)]
        why = []
        if pos is not None:
            why.append(f"token {pos} is {y[pos] if pos < len(y) else 'end'}, the reference's "
                       f"{x[pos] if pos < len(x) else 'end'}")
        elif worst > tol or (math.isnan(worst) and not bad):
            why.append(f"tokens identical, a logprob moved {worst:.3g}")
        why += [f"{len(bad)} non-finite logprob(s), first at position {bad[0]}"] if bad else []
        said += [f"request {r}: " + "; ".join(why)] if why else []
    return said


def memory_held(got: dict, memory: dict) -> list[str]:
    """Each cycle's sleep freed at least ``freed_min`` of the expected bytes, and its wake came back within
    ``restore_tol``; [] when it did, or when there is no CUDA to measure."""
    said = []
    for n in memory["cycles"]:
        before, asleep, awake = (got.get(f"{s} {n}") for s in ("before", "asleep", "awake"))
        if None in (before, asleep, awake):
            print(f"  cycle {n}: memory not measured (no CUDA device)")
            continue
        freed, expected = before - asleep, memory["expected_bytes"]
        print(f"  cycle {n}: asleep {freed / MiB:.1f} MiB freed (expected {expected / MiB:.1f} MiB); awake "
              f"{(awake - before) / MiB:+.1f} MiB against before")
        if freed < memory["freed_min"] * expected:
            said.append(f"cycle {n}: asleep, {freed / MiB:.1f} MiB freed of {expected / MiB:.1f} MiB expected")
        if abs(awake - before) > memory["restore_tol"] * max(expected, freed, MiB):
            said.append(f"cycle {n}: awake, {(awake - before) / MiB:+.1f} MiB against before the sleep")
    return said


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        engine_run()
        return 0
    print(f"reproducing: {CASE['title']}")
    print(f"kvdiag saw: {CASE['kvdiag_saw']}")
    got, end, tail = in_fresh_process()
    if not end.get("started"):
        print(f"the engine did not start (exit {end['exit']}); the end of its output:\n{tail}", file=sys.stderr)
        return 2
    if end.get("ours"):
        print(f"the script could not fill the free blocks: {end['error']}", file=sys.stderr)
        return 2
    said = []
    for ref, later in CASE["compare"]:
        if ref in got and later in got:
            said += [f"{later}: {line}" for line in held(got[ref], got[later], CASE["tolerance"])]
    if CASE.get("memory"):
        said += memory_held(got, CASE["memory"])
    for label in [k for k in got if k.startswith("scan ")]:  # the slots each poisoned wave wrote
        n = got[label]
        if n["nonfinite"]:
            said.append(f"{label[5:]}: {n['nonfinite']} of the {n['written']} KV slots it wrote hold NaN/Inf")
        else:
            print(f"  {label[5:]}: none of the {n['written']} KV slots it wrote holds NaN/Inf")
    for line in said:
        print("  " + line)
    if not end.get("done"):
        died = end.get("error") or f"the engine's process died (exit {end['exit']}):\n{tail}"
        print(f"  the engine failed before its steps ended: {died}")
        if missing := [r for r, _ in CASE["compare"] if r not in got]:
            print(f"  (before its reference run '{missing[0]}' ended: nothing to compare)")
            return 2
        print("REPRODUCED: the engine failed after its reference run" + (f", and {len(said)} difference(s)"
                                                                         if said else ""))
        return 1
    if said:
        print(f"REPRODUCED: {len(said)} difference(s) beyond kvdiag's rule (tolerance {CASE['tolerance']:.3g})")
        return 1
    if not CASE["compare"]:
        print("NOT REPRODUCED: no KV slot a wave wrote holds NaN/Inf")
        return 0
    print(f"NOT REPRODUCED: every later run matched its reference (tolerance {CASE['tolerance']:.3g})"
          + (", and memory was freed and came back" if CASE.get("memory") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
