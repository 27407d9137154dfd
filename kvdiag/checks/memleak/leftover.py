"""memleak's finding on processes: what the engine started and did not stop (docs/DESIGN.md, "memleak").

An engine that runs outside kvdiag's worker process (vLLM's workers under tensor parallelism or
``distributed_executor_backend=mp``) must stop every process it started when it shuts down. After each
shutdown memleak waits up to the engine's ``children_exit_s`` (kvdiag.engines.traits) for the processes it did
not have at the baseline to end, then names those still alive (their GPU memory is NVML's, where NVML's pids are
this machine's):

- error ``engine_process_alive``: one of them holds GPU memory, or more are alive after every cycle;
- warning ``process_alive``: the same ones after every cycle, holding no GPU memory NVML can see (a pool the
  process keeps for its life, such as torch's compile workers, or a worker ``shutdown()`` left behind).
"""

from __future__ import annotations

from kvdiag.measure.memory import MiB

NAMED = 4  # processes named in a message
HOLDER = "processes the engine started and did not stop"


def holders(processes: dict) -> list[dict]:
    """memleak's holders of GPU memory after a shutdown: each process still alive that holds some."""
    return [{"holder": f"{HOLDER}: pid {pid} `{p['cmd']}`", "bytes": int(p["gpu_mib"] * MiB)}
            for pid, p in processes.items() if p.get("gpu_mib")]


def gpu_bytes(alive: list[dict]) -> list[int]:
    """Per cycle, the GPU memory of the processes alive after its shutdown."""
    return [int(sum(p.get("gpu_mib") or 0 for p in a.values()) * MiB) for a in alive]


def new_processes(base, now) -> dict:
    """The processes of snapshot ``now`` that snapshot ``base`` did not have: pid -> {"cmd", "gpu_mib"}."""
    return {pid: p for pid, p in (now.processes or {}).items() if pid not in (base.processes or {})}


def findings(rec, alive: list[dict]) -> None:
    """``alive``: per cycle, the processes alive after its shutdown that the baseline did not have."""
    counts = [len(a) for a in alive]
    rec.metrics["processes_after_shutdown"] = counts
    last = alive[-1] if alive else {}
    if not last:
        return
    holding = {pid: p for pid, p in last.items() if p.get("gpu_mib")}
    grows = len(counts) > 1 and all(b > a for a, b in zip(counts, counts[1:]))
    named = "; ".join(f"pid {pid} `{p['cmd']}`" + (f" holding {p['gpu_mib']:.0f} MiB of GPU memory"
                      if p.get("gpu_mib") else "") for pid, p in sorted(last.items(), key=_gpu_first)[:NAMED])
    named += f"; and {len(last) - NAMED} more" if len(last) > NAMED else ""
    evidence = {"processes": {str(k): v for k, v in last.items()}, "counts": counts}
    if holding or grows:
        why = f"{sum(p['gpu_mib'] for p in holding.values()):.0f} MiB of GPU memory held" if holding else \
            f"more after every cycle ({' -> '.join(map(str, counts))})"
        wait = rec.metrics.get("children_exit_s", 0)
        rec.add("error", "engine_process_alive", f"{len(last)} process(es) started during the run are alive "
                f"{wait:g} s after shutdown(), {why}: {named}; holder: processes shutdown() did not stop",
                **evidence)
    else:
        rec.add("warning", "process_alive", f"{len(last)} process(es) started during the run are alive after "
                f"shutdown ({' -> '.join(map(str, counts))} per cycle), holding no GPU memory NVML can see (a pool "
                f"the process keeps, or workers shutdown() did not stop): {named}", **evidence)


def _gpu_first(item):
    pid, p = item
    return -(p.get("gpu_mib") or 0), pid
