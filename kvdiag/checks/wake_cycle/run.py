"""The wake_cycle check in the worker (the registry's target)."""

from __future__ import annotations

from kvdiag.checks import greedy, kv_tensors, kv_where
from kvdiag.checks.common import (
    device_info,
    engine_failed,
    engine_spec,
    failure_evidence,
    replay_of,
    spec_starter,
    start_or_record,
)
from kvdiag.checks.kv_where import on_kv
from kvdiag.checks.wake_cycle import kv_steps, mem_probe
from kvdiag.checks.wake_cycle.params import WakeParams
from kvdiag.engines.protocol import WorkerProcesses
from kvdiag.errors import EngineUnsupported, first_line

FREED_MIN = 0.9  # asleep, at least this fraction of the expected bytes must be gone
RESTORE_TOL = 0.1  # awake, memory within this fraction of the freed bytes of its level before sleep


CYCLES = "sleep/wake cycles"  # the case's stage after its engine started


def run(case, ctx):
    """Case function (runner target ``kvdiag.checks.wake_cycle.run:run``). The record's ``seconds``: the engine's
    start, the cycles (with the reference outputs) and its shutdown, as tests/support/vllm_gpu_probe.py's ``wake`` mode
    times the same phases of a plain script."""
    import time

    p = WakeParams.from_case(case)
    t0 = time.perf_counter()
    ctx.stage(case, "engine start")
    engine, failed = start_or_record(case, spec_starter(engine_spec(case, enable_sleep=True)), alone=True)
    if failed is not None:
        return failed
    t1 = time.perf_counter()
    rec = None
    try:
        caps = engine.capabilities
        if p.level not in caps.sleep_levels:
            levels = ", ".join(map(str, caps.sleep_levels)) or "none"
            why = caps.sleep_reason or f"sleep level {p.level} unsupported (levels: {levels})"
            return greedy.unsupported(case, why)
        ctx.stage(case, CYCLES)
        rec = _run_cycles(case, engine, p, lambda **m: ctx.keep(case, "reference run", **m))
    except Exception as e:  # noqa: BLE001 - the engine raised in a cycle (a device fault after a wake): crashed there
        rec = engine_failed(case, e, CYCLES)
    finally:
        t2 = time.perf_counter()
        try:
            engine.shutdown()
        except Exception:  # after a crash the shutdown may fail too: the crash is the case's record
            if rec is None or rec.status != "crashed":
                raise
    rec.metrics["seconds"] = {"start": round(t1 - t0, 3), "cycles": round(t2 - t1, 3),
                              "shutdown": round(time.perf_counter() - t2, 3)}
    return rec


def _run_cycles(case, engine, p: WakeParams, keep=None):
    """The cycles; ``keep(**metrics)`` (the worker's ``ctx.keep``) is given what a reproducer needs before the first
    sleep, so that a worker a wake kills leaves it in its crashed record."""
    prompts = greedy.prompt_texts(case.model, case.params.get("num_prompts"))
    base = engine.generate(prompts, p.max_tokens, greedy=True)
    expected = _expected_bytes(engine, p.level)
    replay = {"level": p.level, "staged": p.staged, "max_tokens": p.max_tokens,
              "expected_bytes": expected["expected_bytes"], **_replay(engine, base)}
    if keep is not None and "replay" in replay:
        keep(**replay)
    rec = case.result("pass", metrics={"prompts": len(prompts), **expected, "cycles": [], **replay},
                      environment={**device_info(), **engine.versions()})
    unscanned = kv_where.workers_problem(engine) if expected["worker_processes"] else None
    if unscanned:  # the cache lives in the engine's worker processes (vLLM with several GPUs) and cannot be viewed
        rec.add("info", "kv_not_scanned", f"the KV cache is in {len(expected['worker_processes'])} worker processes "
                f"and out of reach there ({unscanned}): its size is asked inside them, its slots are not scanned; "
                "memory is judged on what the engine's processes hold on its GPUs (NVML), outputs token for token")
    elif expected["device"] is None:
        rec.add("info", "kv_not_scanned", f"the KV cache is out of reach ({engine.capabilities.kv_access_reason}): "
                "its slots are not scanned and no size is expected; memory is judged on what the engine's "
                "processes hold on its GPUs (NVML), outputs token for token")
    pre = greedy.compare(base, base)
    if pre.nonfinite:
        rec.add("error", "nan_output", f"before any sleep: {pre.nonfinite} non-finite logprobs, "
                                       f"first {pre.first_nonfinite}")
    for n in range(1, p.cycles + 1):
        try:
            row, problems = _cycle(engine, n, p, prompts, base, expected["expected_bytes"], case.params.get("device"))
        except EngineUnsupported as e:
            return greedy.unsupported(case, str(e))
        except Exception as e:  # noqa: BLE001 - an engine raising mid-cycle is what this check looks for
            ev = failure_evidence(case, e, CYCLES, sleep_level=p.level)
            where = f" (raised in {ev['where']})" if "where" in ev else ""
            rec.add("error", "engine_error", f"cycle {n}: {type(e).__name__}: {first_line(e)}"[:400] + where,
                    **ev, cycle=n)
            break
        rec.metrics["cycles"].append(row)
        for kind, message in problems:
            _add_once(rec, kind, message, n)
    rec.status = "fail" if any(f.severity == "error" for f in rec.findings) else "pass"
    return rec


def _replay(engine, base) -> dict:
    """What the case's reproducer runs again (``repro.py``): the engine's start, and the prompts as token ids
    (``prompt_ids``: the case's ``prompts`` is their count)."""
    got = replay_of(engine, [c.prompt_token_ids for c in base])
    return {"replay": got["replay"], "prompt_ids": got["prompts"]} if got else {}


def _expected_bytes(engine, level: int) -> dict:
    view = engine.kv_blocks()
    kv = kv_tensors.kv_bytes(view) if view is not None else None
    device = view.layers[0].k.device if view is not None else None
    del view  # no reference of ours may keep the cache alive while the engine sleeps
    workers = _worker_states(engine) if device is None else None
    if workers:  # the cache is in the engine's worker processes, one per GPU: asked inside them
        kv = sum(n for w in workers for _, _, n in w["kv"])
        weights, device = sum(w["weight_bytes"] for w in workers), "cuda"
    else:
        weights = mem_probe.weight_bytes(engine, device)
    weights_leave = level == 2 or (device is not None and str(device) != "cpu")
    parts = [kv, weights if weights_leave else 0]
    return {"device": str(device) if device is not None else None, "expected_kv_bytes": kv,
            "expected_weight_bytes": weights, "weights_leave_device": weights_leave,
            "expected_bytes": None if None in parts else sum(parts),
            "worker_processes": [{k: w[k] for k in ("pid", "gpu")} for w in workers] if workers else None}


def _worker_states(engine) -> list | None:
    return engine.worker_states() if isinstance(engine, WorkerProcesses) else None


def _cycle(engine, n: int, p: WakeParams, prompts, base, expected: int | None, asked: str | None) -> tuple[dict, list]:
    """One sleep/wake cycle: its table row and its problems [(kind, message)]; ``asked``: the case's device."""
    device = _scrub(engine, asked)
    if device.type == "cuda":  # kvdiag's own temporaries (scrub, the last scan) out of the caching allocator's
        import torch  # cache: the sleep's empty_cache would free them and the wake never bring them back

        torch.cuda.empty_cache()
        if isinstance(engine, WorkerProcesses):  # the same in the engine's worker processes, whose cached blocks a
            engine.empty_worker_caches()  # wake does not bring back (docs/vllm-gpu-results.md)
    before = mem_probe.measure(device, "before", n)
    engine.sleep(p.level)
    asleep = mem_probe.measure(device, "asleep", n)
    for tags in ([["weights"], ["kv_cache"]] if p.staged else [None]):
        engine.wake_up(tags)
    awake = mem_probe.measure(device, "awake", n)
    mem = mem_probe.judge(device, before, asleep, awake, expected, FREED_MIN, RESTORE_TOL)
    scanned = _reachable(engine, kv_steps.mark)
    out = engine.generate(prompts, p.max_tokens, greedy=True)
    diff = greedy.compare(base, out)
    scan = kv_tensors.SlotScan.merged(on_kv(engine, kv_steps.scan_written)) if scanned else kv_tensors.SlotScan()
    problems = mem.problems + _output_problems(diff, scan, p, prompts, engine)
    row = {"cycle": n, "level": p.level, "staged": p.staged, **mem.row(), "identical": diff.identical,
           "max_dlogprob": diff.max_dlogprob, "nonfinite_logprobs": diff.nonfinite, "kv_slots_scanned": scan.slots,
           "kv_nonfinite": scan.nonfinite, "kv_bad_scales": scan.bad_scales, "first_difference": diff.first or None,
           "problems": [k for k, _ in problems]}
    return row, problems


def _output_problems(diff, scan, p: WakeParams, prompts, engine) -> list:
    problems = []
    if not diff.identical:
        problems.append(("divergence", greedy.describe(diff, prompts, engine.decode)))
    elif diff.exceeds(p.logprob_tol):
        problems.append(("logprob_drift", f"tokens identical but max |Δ logprob| {diff.max_dlogprob:.3g} "
                                          f"> {p.logprob_tol:g}"))
    if diff.nonfinite:
        problems.append(("nan_output", f"{diff.nonfinite} non-finite logprobs, first {diff.first_nonfinite}"))
    if not scan.ok:
        problems.append(("nan_kv", f"KV cache after wake: {scan.nonfinite} slots with NaN/Inf K/V, "
                                   f"{scan.bad_scales} bad scales; first at {scan.first}"))
    return problems


def _scrub(engine, asked: str | None):
    """Zero the free blocks of the cache about to be dropped, where it is (``kv_steps.scrub``); returns the cache's
    device (where it is out of reach, the case's, ``asked``: a GPU where one is visible, unless it says cpu)."""
    import torch

    devices = _reachable(engine, kv_steps.scrub)
    if devices:
        return torch.device(devices[0].split(":")[0] if len(devices) > 1 else devices[0])
    return torch.device("cuda" if torch.cuda.is_available() and (asked or "auto") != "cpu" else "cpu")


def _reachable(engine, step) -> list | None:
    """``step`` run where the KV cache is (one result per process holding a part of it); None when out of reach."""
    try:
        return on_kv(engine, step)
    except EngineUnsupported:
        return None
    except RuntimeError:  # a worker that cannot view its cache (vLLM wraps its KVAccessError): kv_not_scanned says so
        if kv_where.in_workers(engine):
            return None
        raise


def _add_once(rec, kind: str, message: str, cycle: int) -> None:
    """One finding per kind: the first cycle's message; later cycles extend its evidence."""
    for f in rec.findings:
        if f.kind == kind:
            f.evidence["cycles"].append(cycle)
            return
    rec.add("error", kind, f"cycle {cycle}: {message}", cycles=[cycle])


