"""The memleak verdict: one policy for every engine (this package's docstring, docs/DESIGN.md "memleak")."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiag.checks.memleak import kv_identity, kv_ratio, kv_scaled, kv_shape, leftover, surviving
from kvdiag.measure.memory import (
    MiB,
    Snapshot,
    Survivors,
    to_mib,
)

RETAIN_MIN = 64 * MiB


RETAIN_FRACTION = 0.05  # the retention limit: max(64 MiB, 5% of the engine's peak)


DRIVER_ALLOWANCE = 128 * MiB  # the driver's views also hold the CUDA runtime's per-process memory (docs/DESIGN.md)


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
    steps = kv_ratio.same_phase_steps(cycles, len(after))  # --kv-sizes: never across the change of size
    growth = {m: [v[i + 1] - v[i] for i in steps] for m, v in series.items()}
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
    kv_shape.findings(rec, cycles)
    kv_ratio.findings(rec, cycles)
    grew = _growth_findings(rec, growth, lim, cublas, leftover.gpu_bytes([c.processes for c in cycles]),
                            [f"{i + 1}→{i + 2}" for i in steps])
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
        evidence["reproduce"] = plain["command"]  # kvdiag.proof runs it again: one plain run may be luck either way
    if "use_count > 0" in restart["message"]:
        why += ("; the CUDA caching allocator refuses to capture into a graph pool whose graphs are all gone but "
                "which still holds memory (vLLM 0.24 shares one graph pool among every engine of the process: "
                "docs/vllm-findings.md 16)")
    rec.add("error", "restart_impossible", f"cycle {n}: the engine cannot be started again in this process: "
            f"{restart['message']}; after the first shutdown it still held {kept}{why}", **evidence)


def _growth_findings(rec, growth: dict[str, list[int]], lim: Limits, cublas: int | None = None,
                     procs: list[int] = (), labels: list[str] | None = None) -> set[str]:
    """``procs``: per cycle, the GPU memory of the processes the engine left running (the driver's views' holder
    when it grows every step); ``labels``: each step's cycles ("1→2")."""
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
                    + ", ".join(f"{step}: {x / MiB:+.1f} MiB" for step, x in zip(labels or _steps(steps), steps))
                    + f" (tolerance {tol / MiB:.1f} MiB per step){why}", metric=m,
                    growth_mib=[to_mib(x) for x in steps], threshold_mib=to_mib(tol), holder=holder,
                    holder_mib=to_mib(amount) if holder else None)
    return grew


def _steps(values: list) -> list[str]:
    return [f"{i + 1}→{i + 2}" for i in range(len(values))]


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
    kv_scaled: list = field(default_factory=list)  # Holders whose survivors sum to 1% of the KV cache (kv_scaled.py)
    kv_shaped: list = field(default_factory=list)  # Holders of survivors shaped by the KV cache (kv_shape.py)
    kv_shapes: list = field(default_factory=list)  # their shapes, as the finding writes them
    side: list = field(default_factory=list)  # Holders of the survivors not the KV cache's own (kv_ratio.py)
    kv_size: int | None = None  # the KV cache's blocks this cycle ran with (--kv-sizes), None: the case's own
    seconds: dict = field(default_factory=dict)  # start, workload, snapshot, shutdown, after_shutdown
    replay: dict = field(default_factory=dict)  # the engine's start and the prompts' ids (common.replay_of)
