"""Cases -> isolated worker processes -> results (docs/DESIGN.md, "Running cases").

Each group of cases runs in its own *spawned* worker process (CUDA-safe; or forked from a
fork server that pre-imported the heavy modules, when the caller names them). The engine
runs in-process inside that worker, so memory is measured where it lives. A worker
that segfaults, aborts, is OOM-killed, hangs past its timeout or raises becomes that
case's record, and the run goes on. Every finished case is appended to results.jsonl
at once; ``resume`` skips the ids already recorded.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from kvdiag.errors import resource_failure
from kvdiag.results import CaseResult, append_jsonl, read_jsonl
from kvdiag.scheduling import VISIBLE as GPU_ENV

LOG_TAIL_CHARS = 4000


@dataclass
class Case:
    check: str
    engine: str
    model: str
    kv_dtype: str
    target: str  # "package.module:function", called in the worker as function(case, ctx)
    params: dict = field(default_factory=dict)
    id: str = ""
    timeout: float | None = None  # seconds; None: the runner's default
    group: str | None = None  # cases of one group share one worker (``--isolate run``)

    def __post_init__(self):
        if not self.id:
            label = Path(self.model.rstrip("/")).name or self.model
            self.id = f"{self.check}/{self.engine}/{label}/{self.kv_dtype}"

    def result(self, status: str, **kw) -> CaseResult:
        """A record for this case, with the identifying fields filled in."""
        return CaseResult(id=self.id, check=self.check, engine=self.engine, model=self.model,
                          kv_dtype=self.kv_dtype, status=status, params=dict(self.params), **kw)


@dataclass
class WorkerContext:
    """What a case function gets besides its case: where to put artifacts and how to talk."""

    run_dir: Path
    artifacts_dir: Path

    def artifact(self, case: Case, suffix: str) -> Path:
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        return self.artifacts_dir / f"{safe_name(case.id)}{suffix}"


def safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_")


def call_target(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------- worker side


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


def _worker_main(cases: list[dict], run_dir: str, log_path: str, conn, parent_pid: int, env: dict,
                 threads: int = 1) -> None:
    # Everything the worker and its native libraries print goes to the case log.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    import faulthandler

    faulthandler.enable()  # a segfault writes the Python stack into the log
    os.environ.update(env)
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS"):  # preloaded by a fork server: set what it read
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    _watch_parent(parent_pid)
    ctx = WorkerContext(Path(run_dir), Path(run_dir) / "artifacts")
    if threads > 1 and len(cases) > 1:
        _run_on_threads(cases, ctx, conn, threads, env)
    else:
        for cd in cases:
            conn.send(_started(cd))
            conn.send(("done", _run_one(Case(**cd), ctx)))
    conn.close()


def _started(cd: dict) -> tuple:
    """The "start" message: the case and the size of the log before its first line (its tail starts there)."""
    sys.stdout.flush()
    return "start", (cd["id"], os.fstat(1).st_size)


def _run_one(case: Case, ctx: WorkerContext) -> str:
    """One case in this worker: its record as JSON (an exception becomes an ``error`` record, its finding
    ``resource`` when the device ran out of memory, else ``exception``)."""
    print(f"=== case {case.id} ===", flush=True)
    t0 = time.perf_counter()
    try:
        rec = call_target(case.target)(case, ctx)
        if not isinstance(rec, CaseResult):
            raise TypeError(f"{case.target} returned {type(rec).__name__}, not CaseResult")
    except BaseException as e:  # noqa: BLE001 - a case's failure is its record
        tb = traceback.format_exc()
        print(tb, flush=True)
        rec = case.result("error", log_tail=tb[-LOG_TAIL_CHARS:])
        resource = resource_failure(e)  # out of memory: the run's error, never an engine's refusal
        rec.add("error", "resource" if resource else "exception",
                resource or f"{type(e).__name__}: {e}".splitlines()[0][:500])
    rec.duration_s = rec.duration_s or round(time.perf_counter() - t0, 3)
    return rec.to_json()


def _run_on_threads(cases: list[dict], ctx: WorkerContext, conn, threads: int, env: dict) -> None:
    """Up to ``threads`` cases of the group at once, each on its own thread (``run_cases(threads=...)``). With
    KVDIAG_SHARE_CORES each thread sets its own torch threads (per-thread in OpenMP) as workers would."""
    import threading

    todo, lock = list(cases), threading.Lock()

    def send(msg):
        with lock:
            conn.send(msg)

    def loop():
        while True:
            with lock:
                if not todo:
                    return
                cd, left = todo.pop(0), len(todo) + 1
            if SHARE_CORES in env:
                import torch

                torch.get_num_threads()  # torch's lazy per-thread init first: it would apply the process-wide count
                torch.set_num_threads(int(_share_cores(env, threads, left)["OMP_NUM_THREADS"]))  # then its own
            send(_started(cd))
            send(("done", _run_one(Case(**cd), ctx)))

    pool = [threading.Thread(target=loop, name=f"case-thread-{i}") for i in range(min(threads, len(cases)))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


# --------------------------------------------------------------------------- parent side


class Progress:
    """Plain progress lines on stderr (CI logs); RichProgress draws a bar on a terminal."""

    def __init__(self, total: int, quiet: bool = False):
        self.total, self.done, self.started, self.quiet = total, 0, 0, quiet

    def start(self, case: Case) -> None:
        self.started += 1
        if not self.quiet:
            print(f"[{self.started}/{self.total}] {case.id} ...", file=sys.stderr, flush=True)

    def finish(self, rec: CaseResult) -> None:
        self.done += 1
        if not self.quiet:
            print(f"[{self.done}/{self.total}] {rec.id}: {rec.status} ({rec.duration_s:.1f}s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class RichProgress(Progress):
    def __init__(self, total: int, quiet: bool = False):
        super().__init__(total, quiet)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.rp = RP(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=self.console, transient=False)
        self.task = self.rp.add_task("starting", total=total)
        self.rp.start()

    def start(self, case: Case) -> None:
        self.rp.update(self.task, description=case.id)

    def finish(self, rec: CaseResult) -> None:
        self.done += 1
        style = {"pass": "green", "skipped": "yellow"}.get(rec.status, "red")
        self.rp.console.print(f"[{style}]{rec.status:>8}[/] {rec.id} ({rec.duration_s:.1f}s)")
        self.rp.update(self.task, advance=1)

    def close(self) -> None:
        self.rp.stop()


def make_progress(total: int, quiet: bool = False) -> Progress:
    if not quiet and sys.stderr.isatty() and not os.environ.get("CI"):
        return RichProgress(total)
    return Progress(total, quiet)


def _tail(path: Path, start: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(start, os.path.getsize(path) - LOG_TAIL_CHARS))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _describe_exit(code: int | None) -> tuple[str, dict]:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {"SIGKILL": " (killed: out of memory?)", "SIGSEGV": " (segmentation fault)",
                "SIGABRT": " (aborted)", "SIGBUS": " (bus error)"}.get(name, "")
        return f"worker died with {name}{hint}", {"signal": name, "exit_code": code}
    return f"worker exited with code {code} before reporting", {"exit_code": code}


def _mp_context(preload: tuple[str, ...] = ()):
    """``spawn``; with ``preload``, a fork server that imports those modules once and forks each worker from
    itself (a worker then starts in milliseconds instead of re-importing torch & co.; still a fresh process
    for the engine, and CUDA-safe as long as the preloaded modules do not initialise CUDA)."""
    if not preload:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


SHARE_CORES = "KVDIAG_SHARE_CORES"


def _share_cores(env: dict, jobs: int, left: int) -> dict:
    """With ``KVDIAG_SHARE_CORES=N`` in ``env``, a worker's torch threads: N shared by the workers that can still
    run at once, ``min(jobs, groups not started yet, its own included)``; the last groups of a sweep get the cores
    the finished ones freed (7 dtypes on 2 single-thread workers: the 7th runs alone with 2 threads)."""
    if SHARE_CORES not in env:
        return env
    return {**env, "OMP_NUM_THREADS": str(max(1, int(env[SHARE_CORES]) // max(1, min(jobs, left))))}


@contextlib.contextmanager
def _environ(env: dict):
    """``os.environ`` updated with ``env`` inside the block, restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Worker:
    """One worker process and the cases it still owes: ``running`` (it said "start"), then the rest in order."""

    def __init__(self, cases: list[Case], run_dir: Path, default_timeout: float, env: dict,
                 preload: tuple[str, ...] = (), threads: int = 1):
        self.pending = list(cases)
        self.default_timeout = default_timeout
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{safe_name(cases[0].id if len(cases) == 1 else cases[0].group or cases[0].id)}.log"
        ctx = _mp_context(preload)
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_worker_main,
            args=([asdict(c) for c in cases], str(run_dir), str(self.log_path), child, os.getpid(), env, threads),
            daemon=False,
        )
        with _environ(env):  # a fork server starts with the first worker: its preloaded native libraries read
            self.proc.start()  # their settings (OpenMP: OMP_WAIT_POLICY) once, at load
        child.close()
        self.running: dict[str, float] = {}  # case id -> when the worker started it
        self.log_from: dict[str, int] = {}  # case id -> the log's size then (its tail starts there)
        self.idle_since = time.monotonic()  # no case running: since the spawn or the last result
        self.eof = False
        self.gpu: str | None = None  # the GPU this worker was given (run_cases(gpus=...))

    def _case(self, case_id: str) -> Case:
        return next(c for c in self.pending if c.id == case_id)

    def _timeout(self, case: Case) -> float:
        return case.timeout or self.default_timeout

    def overdue(self) -> list[Case]:
        """The running cases past their timeout (before any started: the next one, counted from idle_since)."""
        now = time.monotonic()
        if not self.running:
            c = self.pending[0]
            return [c] if now > self.idle_since + self._timeout(c) else []
        return [c for c in self.pending if c.id in self.running and now > self.running[c.id] + self._timeout(c)]

    def poll(self) -> tuple[list[Case], list[CaseResult]]:
        """(cases that started, records of cases that ended) since the last poll; a dead or hung worker's owed
        cases become records. Non-blocking."""
        started, out = [], []
        while self.pending and not self.eof and self.conn.poll(0):
            try:
                kind, data = self.conn.recv()
            except (EOFError, OSError):
                self.eof = True
                break
            if kind == "start":
                case_id, self.log_from[case_id] = data
                self.running[case_id] = time.monotonic()
                started.append(self._case(case_id))
                continue
            rec = CaseResult.from_json(data)
            self.pending.remove(self._case(rec.id))
            self.running.pop(rec.id, None)
            out.append(rec)
            self.idle_since = time.monotonic()
        if not self.pending:
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()
            return started, out
        if not self.proc.is_alive():
            self.proc.join()
            if not self.eof and self.conn.poll(0):  # a result raced with the exit
                more_started, more = self.poll()
                return started + more_started, out + more
            out += self._fail_rest("crashed", *_describe_exit(self.proc.exitcode))
        elif late := self.overdue():
            self.proc.kill()
            self.proc.join()
            t = self._timeout(late[0])
            out += self._fail_rest("timeout", f"no result after {t:g}s; worker killed", {"timeout_s": t}, late)
        return started, out

    def _fail_rest(self, status: str, message: str, evidence: dict, culprits: list[Case] | None = None
                   ) -> list[CaseResult]:
        """Records for every owed case: ``culprits`` (default: the running cases, or the next one) get ``status``;
        other cases the worker was running were cut short, and the rest never ran."""
        now = time.monotonic()
        running = [c for c in self.pending if c.id in self.running]
        culprits = culprits or running or self.pending[:1]
        tail = _tail(self.log_path, min(self.log_from.get(c.id, 0) for c in culprits))
        recs = []
        for c in self.pending:
            if c in culprits:
                since = self.running.get(c.id, self.idle_since)
                r = c.result(status, log_tail=tail, duration_s=round(now - since, 3))
                r.add("error", status, message + _also(culprits, c), **evidence)
            else:
                r = c.result("error")
                what = "was cut short" if c in running else "not run"
                r.add("error", "not_run", f"{what}: the shared worker {status} during {culprits[0].id}")
            recs.append(r)
        self.pending, self.running = [], {}
        return recs


def _also(culprits: list[Case], case: Case) -> str:
    others = [c.id for c in culprits if c is not case]
    return f" (the worker was also running {', '.join(others)})" if others else ""


def run_cases(
    cases: Iterable[Case],
    run_dir: Path,
    *,
    timeout: float = 600.0,
    resume: bool = False,
    jobs: int = 1,
    quiet: bool = False,
    env: dict | None = None,
    preload: tuple[str, ...] = (),
    threads: int = 1,
    gpus: Iterable[str] = (),
) -> list[CaseResult]:
    """Run cases in workers; return the records of all cases (recorded earlier ones too, on resume).
    ``preload``: modules a fork server imports once for all workers (see ``_mp_context``). ``threads``: cases of
    one group that its worker runs at once, on threads (only for case functions that are safe to run so); a
    crash or a timeout then ends the cases the worker was running, and the rest of its group. ``gpus``: GPUs
    (CUDA_VISIBLE_DEVICES entries) to give the workers one each, no two workers at once the same
    (``kvdiag.scheduling``); a worker waits for a free one."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    results_path = run_dir / "results.jsonl"
    cases = list(cases)
    done = read_jsonl(results_path) if resume else {}
    todo = [c for c in cases if c.id not in done]
    groups: list[list[Case]] = []
    by_group: dict[str, list[Case]] = {}
    for c in todo:
        if c.group is None:
            groups.append([c])
        elif c.group in by_group:
            by_group[c.group].append(c)
        else:
            by_group[c.group] = [c]
            groups.append(by_group[c.group])

    env = {"TOKENIZERS_PARALLELISM": "false", **(env or {})}
    progress = make_progress(len(todo), quiet)
    active: list[_Worker] = []
    free_gpus = list(gpus)
    pinned = bool(free_gpus)
    try:
        while groups or active:
            while groups and len(active) < max(1, jobs) and (free_gpus or not pinned):
                group, gpu = groups.pop(0), free_gpus.pop(0) if pinned else None
                wenv = _share_cores(env, jobs, len(groups) + 1)
                w = _Worker(group, run_dir, timeout, wenv if gpu is None else {**wenv, GPU_ENV: gpu}, preload, threads)
                w.gpu = gpu
                active.append(w)
            time.sleep(0.05)
            for w in list(active):
                started, ended = w.poll()
                for c in started:
                    progress.start(c)
                for rec in ended:
                    append_jsonl(results_path, rec)
                    done[rec.id] = rec
                    progress.finish(rec)
                if not w.pending:
                    active.remove(w)
                    if w.gpu is not None:
                        free_gpus.append(w.gpu)
    finally:
        for w in active:  # interrupted: leave no worker behind
            w.proc.kill()
        progress.close()
    return [done[c.id] for c in cases if c.id in done]
