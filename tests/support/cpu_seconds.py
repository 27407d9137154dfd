"""Time a test may bound: CPU seconds, which a busy machine does not stretch as it stretches the wall clock (CI runs
three test workers on two cores)."""

import resource
import subprocess


def children_cpu() -> float:
    """CPU seconds of this process's finished children (each xdist worker is its own process and runs one test at a
    time, so a difference around one ``subprocess.run`` is that child's)."""
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def timed_run(cmd: list, **kw) -> tuple[subprocess.CompletedProcess, float]:
    """``subprocess.run(cmd, capture_output=True, text=True, **kw)`` and the CPU seconds it took."""
    before = children_cpu()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    return r, children_cpu() - before
