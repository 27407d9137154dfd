"""The engine of a case inside its worker: started per case, or shared by the cases of one worker (``--isolate
run``: a thread's cases re-use its engine, threads share the weights one of them loaded), and this worker's first
case (its start-up time). Module state: what this worker process holds. Used by accuracy and dtypes --check."""

from __future__ import annotations

import threading
import time

from kvdiag.engines.protocol import SharesWeights

_SHARED: dict = {}  # --isolate run: (group, thread) -> the engine object that thread's cases share
_SHARED_LOCK = threading.Lock()  # cases starting at once on threads: one loads the weights, the others share them
_STARTED: list = []  # non-empty once this worker ran its first case


def acquire_engine(case):
    """Start the case's engine; in a shared worker (--isolate run) re-use the one this thread already loaded,
    or share the weights another thread's engine loaded (builtin engine: cases on threads, runner's ``threads``)."""
    from kvdiag.checks.common import engine_spec, start_engine

    if not case.group:
        return start_engine(case)
    with _SHARED_LOCK:
        key = (case.group, threading.get_ident())
        held = _SHARED.get(key)
        if isinstance(held, SharesWeights):
            held.start(engine_spec(case))  # same weights: only the KV cache is re-created
            return held
        if held is not None:
            held.shutdown()
        donors = [donor for (g, _), donor in _SHARED.items() if g == case.group and isinstance(donor, SharesWeights)]
        _SHARED[key] = start_engine(case, weights_from=next((donor for donor in donors if donor.has_weights()), None))
        return _SHARED[key]


def release_engine(case, engine) -> None:
    if not case.group:
        engine.shutdown()


def startup_once() -> float:
    """Seconds from the worker's spawn to its first case (imports included); 0 for later cases."""
    if _STARTED:
        return 0.0
    _STARTED.append(True)
    return round(process_age(), 3)


def process_age() -> float:
    """Seconds since this process was created: on Linux from /proc (clock ticks since boot, exact to 10 ms;
    psutil's create_time adds the boot time, which /proc/stat gives in whole seconds: up to 1 s off)."""
    import os

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return time.time() - psutil.Process(os.getpid()).create_time()
