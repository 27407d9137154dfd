"""Inside a worker process (started by :mod:`kvdiag.run.runner`): its output into the case log, a watch on kvdiag
itself, and its cases one after the other (or several at once on threads), each record sent back as soon as it is
done. A case function that raises becomes that case's ``error`` record (``resource`` for out of device memory)."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

from kvdiag import death
from kvdiag.case import (
    LOG_TAIL_CHARS,
    SHARE_CORES,
    Case,
    WorkerContext,
    add_kept,
    call_target,
    share_cores,
    take_engine_notes,
    take_kept,
)
from kvdiag.errors import resource_failure
from kvdiag.results import CaseResult


def _watch_parent(parent_pid: int) -> None:
    """End the worker if kvdiag itself dies (kill -9), so no orphan keeps the GPU. (A forkserver worker's
    parent is the fork server, which ends with kvdiag: the worker is then re-parented.)"""
    import threading

    first = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != first or not _alive(parent_pid):
                os._exit(70)

    threading.Thread(target=watch, daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _thread_lock_for_tqdm() -> None:
    """Give tqdm (lm_eval's progress bars) a thread lock instead of its default multiprocessing RLock. In a
    worker from the fork server that RLock is a named semaphore registered with kvdiag's resource tracker; a worker
    that never exits normally (killed on Ctrl-C or at a timeout, or ended by ``_watch_parent`` when kvdiag is
    killed) never unregisters it, and the tracker then warns "There appear to be N leaked semaphore objects" on
    kvdiag's stderr. The worker's bars only go to its case log: no other process shares them."""
    try:
        import threading

        from tqdm import tqdm
    except ImportError:  # no tqdm (no lm_eval): nothing to do
        return
    tqdm.set_lock(threading.RLock())


def worker_main(cases: list[dict], run_dir: str, log_path: str, conn, parent_pid: int, env: dict,
                 threads: int = 1) -> None:
    # Everything the worker and its native libraries print goes to the case log.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    import faulthandler

    faulthandler.enable()  # a segfault writes the Python stack into the log
    faulthandler.register(getattr(signal, death.DUMP_SIGNAL), all_threads=True)  # a timeout asks where it hung
    os.environ.update(env)
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS"):  # preloaded by a fork server: set what it read
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    _watch_parent(parent_pid)
    _thread_lock_for_tqdm()
    import threading

    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    ctx = WorkerContext(Path(run_dir), Path(run_dir) / "artifacts", send)
    if threads > 1 and len(cases) > 1:
        _run_on_threads(cases, ctx, send, threads, env)
    else:
        for cd in cases:
            send(_started(cd))
            send(("done", _run_one(Case(**cd), ctx)))
    conn.close()


def _started(cd: dict) -> tuple:
    """The "start" message: the case and the size of the log before its first line (its tail starts there)."""
    sys.stdout.flush()
    return "start", (cd["id"], os.fstat(1).st_size)


def _case_function(case: Case):
    """What runs ``case``: its target where it names one, else its check's ``run`` (found in the registry)."""
    if case.target:
        return call_target(case.target)
    from kvdiag.checks.registry import run_case

    return run_case


def _run_one(case: Case, ctx: WorkerContext) -> str:
    """One case in this worker: its record as JSON (an exception becomes an ``error`` record, its finding
    ``resource`` when the device ran out of memory, else ``exception``)."""
    print(f"=== case {case.id} ===", flush=True)
    t0 = time.perf_counter()
    take_engine_notes()  # a note left by an earlier case of this thread is not this case's
    take_kept(ctx.run_dir, case.id)  # kept by a run of this case that was interrupted (resumed now)
    try:
        rec = _case_function(case)(case, ctx)
        if not isinstance(rec, CaseResult):
            raise TypeError(f"{case.target or case.check} returned {type(rec).__name__}, not CaseResult")
    except BaseException as e:  # noqa: BLE001 - a case's failure is its record
        tb = traceback.format_exc()
        print(tb, flush=True)
        rec = case.result("error", log_tail=tb[-LOG_TAIL_CHARS:])
        resource = resource_failure(e)  # out of memory: the run's error, never an engine's refusal
        kept = add_kept(rec, take_kept(ctx.run_dir, case.id))
        rec.add("error", "resource" if resource else "exception",
                (resource or f"{type(e).__name__}: {e}".splitlines()[0][:500]) + kept)
    for kind, message, evidence in take_engine_notes():
        rec.add("info", kind, message, **evidence)
    take_kept(ctx.run_dir, case.id)  # its record says it all: only a dead worker's case needs what it kept
    rec.duration_s = rec.duration_s or round(time.perf_counter() - t0, 3)
    return rec.to_json()


def _run_on_threads(cases: list[dict], ctx: WorkerContext, send, threads: int, env: dict) -> None:
    """Up to ``threads`` cases of the group at once, each on its own thread (``run_cases(threads=...)``). With
    KVDIAG_SHARE_CORES each thread sets its own torch threads (per-thread in OpenMP) as workers would."""
    import threading

    todo, lock = list(cases), threading.Lock()

    def loop():
        while True:
            with lock:
                if not todo:
                    return
                cd, left = todo.pop(0), len(todo) + 1
            if SHARE_CORES in env:
                import torch

                torch.get_num_threads()  # torch's lazy per-thread init first: it would apply the process-wide count
                torch.set_num_threads(int(share_cores(env, threads, left)["OMP_NUM_THREADS"]))  # then its own
            send(_started(cd))
            send(("done", _run_one(Case(**cd), ctx)))

    pool = [threading.Thread(target=loop, name=f"case-thread-{i}") for i in range(min(threads, len(cases)))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
