"""The whole engine's processes and their GPU memory (docs/DESIGN.md, "Measuring memory").

An engine may run outside kvdiag's worker process: vLLM under tensor parallelism (or
``distributed_executor_backend=mp``) starts one worker process per GPU. The engine is then this process and
every process it started (:func:`children`), on every GPU it uses. :func:`gpu_view` reads NVML once for the
GPUs this process may use (``CUDA_VISIBLE_DEVICES``): each GPU's used memory, and what the process tree holds
on it. NVML names processes by pid; in a container it may list the host's pids, which match none of ours:
then every compute process on those GPUs is counted as the engine's (``matched`` False).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CMD_CHARS = 100


@dataclass
class GpuView:
    used: dict = field(default_factory=dict)  # GPU (CUDA_VISIBLE_DEVICES entry) -> device-wide used bytes
    engine: dict = field(default_factory=dict)  # GPU -> bytes held by this process and its children
    by_pid: dict = field(default_factory=dict)  # pid -> bytes over the visible GPUs (only where pids match)
    matched: bool = True  # NVML's pids are ours (False: another pid namespace; every process counted)

    def measured(self, current: str | None) -> list[str]:
        """The GPUs the engine uses: the current one and those its processes hold memory on (every visible one
        when NVML's pids are not ours)."""
        if not self.matched:
            return list(self.used)
        return [g for g in self.used if g == current or self.engine.get(g)]

    def used_bytes(self, current: str | None) -> int:
        return sum(self.used[g] for g in self.measured(current))

    def engine_bytes(self) -> int | None:
        return sum(self.engine.values()) if self.engine else None


def children() -> dict[int, str]:
    """The live processes this process started, at any depth: pid -> command line (zombies left out)."""
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            out[p.pid] = " ".join(" ".join(p.cmdline()).split())[:CMD_CHARS] or p.name()  # one line
        except psutil.Error:  # ended meanwhile
            continue
    return out


def wait_children(known, seconds: float) -> dict[int, str]:
    """The children not in ``known`` still alive after waiting up to ``seconds`` for them to end."""
    import time

    end = time.monotonic() + seconds
    while True:
        new = {pid: cmd for pid, cmd in children().items() if pid not in known}
        if not new or time.monotonic() >= end:
            return new
        time.sleep(0.2)


def visible_handles(pynvml) -> list[tuple[str, object]]:
    """(CUDA_VISIBLE_DEVICES entry, NVML handle) of each GPU this process may use (indices or UUIDs)."""
    from kvdiag.gpus import visible_gpus

    out = []
    for e in visible_gpus():
        try:
            out.append((e, pynvml.nvmlDeviceGetHandleByIndex(int(e)) if e.isdigit() else
                        pynvml.nvmlDeviceGetHandleByUUID(e)))
        except Exception:  # noqa: BLE001 - as CUDA, the list ends at the first entry with no GPU (an unknown UUID)
            break
    return out


def gpu_view(pids) -> GpuView | None:
    """NVML's view of the visible GPUs, ``pids`` being the engine's processes; None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVIDIA driver
        return None
    try:
        used, procs = {}, {}
        for label, h in visible_handles(pynvml):
            used[label] = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
            procs[label] = [(p.pid, int(p.usedGpuMemory or 0)) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
    except Exception:  # noqa: BLE001 - NVML not supported on this device / driver
        return None
    finally:
        pynvml.nvmlShutdown()
    pids = set(pids)
    matched = any(pid in pids for ps in procs.values() for pid, _ in ps)
    view = GpuView(used, matched=matched or not any(procs.values()))
    if not any(procs.values()):  # NVML lists no process here: it cannot say who holds what
        return view
    for label, ps in procs.items():
        mine = [(pid, n) for pid, n in ps if pid in pids or not matched]
        view.engine[label] = sum(n for _, n in mine)
        if matched:
            for pid, n in mine:
                view.by_pid[pid] = view.by_pid.get(pid, 0) + n
    return view
