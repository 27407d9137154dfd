"""``memleak``: after an in-process engine shuts down, is the memory back, and if not, what holds it (bug class S4)?

Per kv dtype, in a fresh worker: a baseline snapshot, then each cycle creates and starts a
new engine, runs a short workload (prefill + decode of a few prompts), snapshots, shuts
the engine down, cleans up (``gc.collect``, ``torch.cuda.empty_cache`` on CUDA) and
snapshots again, still holding the engine object: what ``shutdown()`` did not release
is named as held by it. :func:`judge` gives the verdict: ``fail`` when tensors the
engine allocated survive shutdown (with their holders), when memory after shutdown grows
from one cycle to the next beyond the threshold, or when objects stay frozen by
``gc.freeze()``. What the first cycle keeps and later cycles do not grow (imports,
allocator arenas, cuBLAS workspaces) is reported, not failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvdiag.checks import greedy
from kvdiag.checks.common import detector_disabled, engine_spec
from kvdiag.engines.base import create_engine
from kvdiag.errors import EngineUnsupported
from kvdiag.memory import MiB, Census, Snapshot, Survivors, cleanup, snapshot, survivors, take_census

MIN_THRESHOLD = 16 * MiB
PEAK_FRACTION = 0.01  # the default threshold: max(16 MiB, 1% of the engine's peak)
EXACT = ("tensor_bytes", "cuda_allocated", "cuda_reserved")  # growth in any step beyond the threshold fails
NOISY = ("rss", "driver_used", "nvml_process")  # must grow beyond it in every step from cycle 2 on
MAX_SMALL_ATTRIBUTED = 200


@dataclass
class LeakParams:
    cycles: int = 3
    threshold_mib: float | None = None  # None: max(16 MiB, 1% of the engine's peak)
    max_tokens: int = 16
    num_prompts: int = 4

    @classmethod
    def from_case(cls, case) -> "LeakParams":
        return cls(**{k: case.params[k] for k in asdict(cls()) if case.params.get(k) is not None})


@dataclass
class Cycle:
    """What one cycle left after shutdown: the survivors and who holds them."""

    survivors: Survivors
    holders: list = field(default_factory=list)  # kvdiag.memory_holders.Holder, largest first


def run(case, ctx):
    """Case function (runner target ``kvdiag.checks.memleak:run``)."""
    p = LeakParams.from_case(case)
    device = case.params.get("device") or "auto"
    cuda = uses_cuda(device)
    prompts = greedy.prompt_texts(case.model)[: p.num_prompts]
    prepare(case.engine, cuda, device)
    base = take_census()
    snaps = [snapshot("baseline", 0, cuda, base)]
    cycles: list[Cycle] = []
    for n in range(1, p.cycles + 1):
        try:
            cycles.append(_cycle(case, n, p, prompts, cuda, base, snaps))
        except EngineUnsupported as e:
            return greedy.skipped(case, str(e))
    counts = [c.survivors.small_count for c in cycles]
    if len(counts) > 1 and all(b > a for a, b in zip(counts, counts[1:])) and \
            not detector_disabled("memleak.holders"):  # tiny survivors that keep coming
        from kvdiag.memory_holders import holders

        last = cycles[-1].survivors
        cycles[-1].holders = holders(last.keys | set(list(last.small_keys)[:MAX_SMALL_ATTRIBUTED]))
    return judge(case.result("pass", metrics={"cuda": cuda, "cycles": p.cycles, "max_tokens": p.max_tokens,
                                              "prompts": len(prompts)}), snaps, cycles, p.threshold_mib)


def uses_cuda(device: str) -> bool:
    import torch

    return device != "cpu" and torch.cuda.is_available()


def prepare(engine: str, cuda: bool, device: str) -> None:
    """Before the baseline: the CUDA context (on the engine's device: snapshots read the current one)
    and the engine's imports (what its modules create at import) belong to the process, not the engine."""
    if cuda:
        import torch

        if device.startswith("cuda:"):
            torch.cuda.set_device(torch.device(device))
        torch.zeros(1, device="cuda")
    create_engine(engine)
    cleanup(cuda)


def _cycle(case, n: int, p: LeakParams, prompts, cuda: bool, base: Census, snaps: list) -> Cycle:
    from kvdiag.memory_holders import holders

    engine = create_engine(case.engine)
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    engine.start(engine_spec(case))
    engine.generate(prompts, p.max_tokens)
    snaps.append(snapshot("after-workload", n, cuda))
    engine.shutdown()
    cleanup(cuda)
    now = take_census()
    snaps.append(snapshot("after-shutdown", n, cuda, now))
    s = survivors(base, now)
    del now
    held = holders(s.keys, {id(engine): f"the engine object ({type(engine).__name__}) after shutdown()"}) \
        if s.keys and not detector_disabled("memleak.holders") else []
    return Cycle(s, held)


# --------------------------------------------------------------------------- verdict


def judge(rec, snaps: list[Snapshot], cycles: list[Cycle], threshold_mib: float | None = None):
    """Fill ``rec`` (status, metrics, findings) from the snapshots and survivors of every cycle."""
    base = snaps[0]
    after = [s for s in snaps if s.stage == "after-shutdown"]
    peak = _peak(base, [s for s in snaps if s.stage == "after-workload"])
    threshold = threshold_mib * MiB if threshold_mib is not None else max(MIN_THRESHOLD, PEAK_FRACTION * peak)
    series = {m: [getattr(s, m) for s in after] for m in EXACT + NOISY if getattr(base, m) is not None}
    growth = {m: [b - a for a, b in zip(v, v[1:])] for m, v in series.items()}
    first = {m: v[0] - getattr(base, m) for m, v in series.items() if v}
    rec.metrics.update({
        "threshold_mib": _mib(threshold), "peak_mib": _mib(peak),
        "snapshots": [s.row() for s in snaps],
        "survivor_mib": [_mib(c.survivors.bytes) for c in cycles],
        "survivor_count": [c.survivors.count for c in cycles],
        "small_survivor_count": [c.survivors.small_count for c in cycles],
        "after_shutdown_mib": {m: [_mib(x) for x in v] for m, v in series.items()},
        "growth_mib": {m: [_mib(x) for x in v] for m, v in growth.items()},
        "first_cycle_cost_mib": {m: _mib(x) for m, x in first.items()},
        "frozen": [s.frozen for s in after], "baseline_frozen": base.frozen,
    })
    _survivor_findings(rec, cycles)
    grew = _growth_findings(rec, growth, threshold)
    kept = {m: _mib(x) for m, x in first.items() if x > threshold and m not in grew}
    if kept:
        rec.add("info", "one_time_cost", "the first cycle kept " + ", ".join(f"{m} {x:.1f} MiB" for m, x in
                kept.items()) + " that later cycles did not grow (imports, allocator arenas, workspaces): not a leak",
                mib=kept)
    if after and after[-1].frozen > base.frozen:
        rec.add("error", "gc_frozen", f"{after[-1].frozen - base.frozen} objects stay frozen by gc.freeze() after "
                "shutdown (no gc.unfreeze()): invisible to gc, their cycles never collected; holder: invisible: "
                "frozen by gc.freeze()", frozen=[s.frozen for s in after], baseline=base.frozen)
    rec.status = "fail" if any(f.severity == "error" for f in rec.findings) else "pass"
    return rec


def _peak(base: Snapshot, workload: list[Snapshot]) -> int:
    """The engine's peak: CUDA's max_memory_allocated over the baseline, else the census at its largest."""
    if base.cuda_allocated is not None:
        return max([s.cuda_peak - base.cuda_allocated for s in workload if s.cuda_peak is not None], default=0)
    return max([s.tensor_bytes - base.tensor_bytes for s in workload], default=0)


def _survivor_findings(rec, cycles: list[Cycle]) -> None:
    last = next((c for c in reversed(cycles) if c.holders), None)
    if last is None:
        return
    per_cycle = [_mib(c.survivors.bytes) for c in cycles]
    for h in last.holders:
        rec.add("error", "tensor_survived", f"{_mib(h.bytes):.3g} MiB in {h.tensors} tensor(s) "
                f"({h.count} storages) survive shutdown, held by {h.holder}", **h.to_json(),
                per_cycle_mib=per_cycle, devices=last.survivors.by_device)


def _growth_findings(rec, growth: dict[str, list[int]], threshold: float) -> set[str]:
    grew = set()
    for m, steps in growth.items():
        bad = [x > threshold for x in steps]
        if steps and (any(bad) if m in EXACT else all(bad)):
            grew.add(m)
            rec.add("error", "growth", f"{m} after shutdown grows from cycle to cycle: "
                    + ", ".join(f"{i + 1}→{i + 2}: {x / MiB:+.1f} MiB" for i, x in enumerate(steps))
                    + f" (threshold {threshold / MiB:.1f} MiB)", metric=m, growth_mib=[_mib(x) for x in steps],
                    threshold_mib=_mib(threshold))
    return grew


def _mib(x) -> float | None:
    return None if x is None else round(x / MiB, 3)
