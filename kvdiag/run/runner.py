"""Cases -> isolated worker processes -> results (docs/DESIGN.md, "Running cases"); what runs inside a worker
is kvdiag/run/worker.py, the progress lines kvdiag/run/progress.py.

Each group of cases runs in its own *spawned* worker process (CUDA-safe; or forked from a
fork server that pre-imported the heavy modules, when the caller names them). The engine
runs in-process inside that worker, so memory is measured where it lives. A worker
that segfaults, aborts, is OOM-killed, hangs past its timeout or raises becomes that
case's record, and the run goes on. Every finished case is appended to results.jsonl
at once; ``resume`` skips the ids already recorded.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

from kvdiag import death
from kvdiag.case import (
    FIRED_MARK,
    KEPT_DIR,
    LOG_TAIL_CHARS,
    REPRODUCE_MARK,
    Case,
    WorkerContext,
    add_kept,
    call_target,
    safe_name,
    share_cores,
    take_kept,
)
from kvdiag.gpus import VISIBLE as GPU_ENV
from kvdiag.results import CaseResult, append_jsonl, read_jsonl
from kvdiag.run.progress import Progress, make_progress

__all__ = ["Case", "WorkerContext", "call_target", "run_cases"]  # Case and WorkerContext live in kvdiag.case

# --------------------------------------------------------------------------- parent side


def _tail(path: Path, start: int = 0, chars: int | None = LOG_TAIL_CHARS) -> str:
    """The log from byte ``start``, its last ``chars`` at most (None: all of it)."""
    try:
        with open(path, "rb") as f:
            f.seek(start if chars is None else max(start, os.path.getsize(path) - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


DUMP_WAIT_S = 3.0  # a hung worker's stack dump: written in milliseconds, unless the machine is swamped


def _size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


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


def died_of(log: str) -> tuple[str, dict]:
    """From a dead worker's log (its case's part): what to add to the finding's message and its evidence: the stage
    its case was in, the line that says what failed and faulthandler's frame (``kvdiag.death``), and the last
    command that repeats its engine's start."""
    why = death.cause(log)
    out = why.evidence()
    commands = [line[len(REPRODUCE_MARK):] for line in log.splitlines() if line.startswith(REPRODUCE_MARK)]
    if commands:
        out["reproduce"] = commands[-1]
    return why.describe() + (f"; reproduce: {commands[-1]}" if commands else ""), out


def fired_marks(log: str) -> dict[str, int]:
    """``{fault: times}`` from the ``FIRED_MARK`` lines of a case's log (the faults whose code ran before it died)."""
    out: dict[str, int] = {}
    for line in log.splitlines():
        if line.startswith(FIRED_MARK):
            name = line[len(FIRED_MARK):].strip()
            out[name] = out.get(name, 0) + 1
    return out


def _mp_context(preload: tuple[str, ...] = ()):
    """``spawn``; with ``preload``, a fork server that imports those modules once and forks each worker from
    itself (a worker then starts in milliseconds instead of re-importing torch & co.; still a fresh process
    for the engine, and CUDA-safe as long as the preloaded modules do not initialise CUDA)."""
    if not preload:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


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


@contextlib.contextmanager
def _main_left_alone():
    """Workers that do not re-import the caller's ``__main__``: multiprocessing re-runs a script's top level in each
    worker (by its path or module name), so a script, ``python -`` or a notebook calling ``kvdiag.run_check`` without
    ``if __name__ == "__main__":`` would run itself again there, or fail to (``<stdin>``). A worker imports what it
    runs by name (``module:function``)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # what multiprocessing.spawn.get_preparation_data reads to re-import it
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class _Worker:
    """One worker process and the cases it still owes: ``running`` (it said "start"), then the rest in order."""

    def __init__(self, cases: list[Case], run_dir: Path, default_timeout: float, env: dict,
                 preload: tuple[str, ...] = (), threads: int = 1):
        self.pending = list(cases)
        self.default_timeout = default_timeout
        self.run_dir = run_dir
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{safe_name(cases[0].id if len(cases) == 1 else cases[0].group or cases[0].id)}.log"
        from kvdiag.run.worker import worker_main

        ctx = _mp_context(preload)
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=worker_main,  # kvdiag.run.worker
            args=([asdict(c) for c in cases], str(run_dir), str(self.log_path), child, os.getpid(), env, threads),
            daemon=False,
        )
        with _environ(env), _main_left_alone():  # a fork server starts with the first worker: its preloaded
            self.proc.start()  # native libraries read their settings (OpenMP: OMP_WAIT_POLICY) once, at load
        child.close()
        self.running: dict[str, float] = {}  # case id -> when the worker started it
        self.log_from: dict[str, int] = {}  # case id -> the log's size then (its tail starts there)
        self.idle_since = time.monotonic()  # no case running: since the spawn or the last result
        self.eof = False
        self.notes: list[tuple[str, str]] = []  # (case id, progress line) received, not yet shown
        self.gpu: str | None = None  # the GPU this worker was given (run_cases(gpus=...))
        self.held: list[str] = []  # its slots of that GPU: one, or all of them for a case that runs alone
        self.alone = False  # it runs alone on its GPU (run_cases(alone=...))

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
            if kind == "progress":
                self.notes.append(data)
                continue
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
            self._dump_stacks()
            self.proc.kill()
            self.proc.join()
            t = self._timeout(late[0])
            out += self._fail_rest("timeout", f"no result after {t:g}s; worker killed", {"timeout_s": t}, late)
        return started, out

    def _dump_stacks(self) -> None:
        """Before a hung worker is killed: its threads' stacks into its log (``death.DUMP_SIGNAL``), where the
        timeout's record reads where it hung. Waits for the log to grow, then to stop growing (at most
        ``DUMP_WAIT_S``): a dump that began late was lost to the kill (two vLLM hangs on the GPU)."""
        before = _size(self.log_path)
        try:
            os.kill(self.proc.pid, getattr(signal, death.DUMP_SIGNAL))
        except (OSError, TypeError):
            return
        last, end = before, time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < end:
            time.sleep(0.2)
            now = _size(self.log_path)
            if last != before and now == last:  # it grew, then stopped
                return
            last = now

    def _fail_rest(self, status: str, message: str, evidence: dict, culprits: list[Case] | None = None
                   ) -> list[CaseResult]:
        """Records for every owed case: ``culprits`` (default: the running cases, or the next one) get ``status``;
        other cases the worker was running were cut short, and the rest never ran."""
        now = time.monotonic()
        running = [c for c in self.pending if c.id in self.running]
        culprits = culprits or running or self.pending[:1]
        start = min(self.log_from.get(c.id, 0) for c in culprits)
        tail = _tail(self.log_path, start)
        if status == "crashed":  # the cause is searched beyond the tail: faulthandler's module list fills that
            log = _tail(self.log_path, start, death.SCAN_BYTES)
            tail = death.readable_tail(log, LOG_TAIL_CHARS)
            why, found = died_of(log)
            message += why
            evidence = {**evidence, **found}
        if status == "timeout" and (where := death.hung_at(_tail(self.log_path, start, death.SCAN_BYTES))):
            message += f"; hung at {' in '.join(where)}"
            evidence = {**evidence, "hung_at": where}
        if status in ("crashed", "timeout"):  # a self-test fault that ran before the worker died or hung says so
            evidence = {**evidence, "fired": fired_marks(_tail(self.log_path, start, None))}
        recs = []
        for c in self.pending:
            if c in culprits:
                since = self.running.get(c.id, self.idle_since)
                r = c.result(status, log_tail=tail, duration_s=round(now - since, 3))
                kept = add_kept(r, take_kept(self.run_dir, c.id))  # what it measured before the worker died
                r.add("error", status, message + _also(culprits, c) + kept, **evidence)
            else:
                r = c.result("error")
                what = "was cut short" if c in running else "not run"
                kept = add_kept(r, take_kept(self.run_dir, c.id))
                r.add("error", "not_run", f"{what}: the shared worker {status} during {culprits[0].id}{kept}")
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
    durations: dict[str, float] | None = None,
    alone: frozenset = frozenset(),
    progress: Progress | None = None,
) -> list[CaseResult]:
    """Run cases in workers; return the records of all cases (recorded earlier ones too, on resume).
    ``preload``: modules a fork server imports once for all workers (see ``_mp_context``). ``threads``: cases of
    one group that its worker runs at once, on threads (only for case functions that are safe to run so); a
    crash or a timeout then ends the cases the worker was running, and the rest of its group. ``gpus``: GPUs
    (CUDA_VISIBLE_DEVICES entries) to give the workers one each, no two workers at once the same
    (``kvdiag.run.scheduling``); a worker waits for a free one. ``durations``: each case's time in an earlier run;
    the workers then take the longest cases first, so that the last ones to start are short (a run of three rounds
    of 12 slots would otherwise end with one long case alone; the records keep the order of ``cases``). ``alone``:
    ids of cases that run with no other worker on their GPU (a check that measures the device, in a run where
    other cases share one: ``Placement.alone``); their workers start after the others', one GPU each.
    ``progress``: the caller's, which it closes (it says the verdicts of the cases judged at the end); default: a
    new one, closed here."""
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
    if durations:
        from kvdiag.run.shards import costs, longest_first

        groups = [groups[i] for i in longest_first(costs(groups, durations))]
    if alone:  # the cases that share a GPU first, side by side; then the rest, each alone on its GPU
        lone = [g for g in groups if any(c.id in alone for c in g)]
        groups = [g for g in groups if not any(c.id in alone for c in g)] + lone

    env = {"TOKENIZERS_PARALLELISM": "false", **(env or {})}
    own = progress is None
    progress = progress or make_progress(len(todo), quiet)
    progress.expect(len(todo))
    active: list[_Worker] = []
    free_gpus = list(gpus)
    slots = {g: free_gpus.count(g) for g in free_gpus}  # a GPU's slots: the cases it takes at once
    try:
        while groups or active:
            while groups and len(active) < max(1, jobs):
                lone = any(c.id in alone for c in groups[0])
                held = _slots(lone, active, free_gpus, slots)
                if held is None:  # the next case waits for its GPU (to itself, or back from one that runs alone)
                    break
                group, gpu = groups.pop(0), held[0] if held else None
                for g in held:
                    free_gpus.remove(g)
                wenv = share_cores(env, jobs, len(groups) + 1)
                w = _Worker(group, run_dir, timeout, wenv if gpu is None else {**wenv, GPU_ENV: gpu}, preload, threads)
                w.gpu, w.held, w.alone = gpu, held, lone
                active.append(w)
            time.sleep(0.05)
            for w in list(active):
                started, ended = w.poll()
                for c in started:
                    progress.start(c)
                for case_id, text in w.notes:
                    progress.note(case_id, text)
                w.notes.clear()
                for case_id, since in w.running.items():
                    if progress.unsaid(case_id):
                        log = _tail(w.log_path, w.log_from.get(case_id, 0), death.SCAN_BYTES)
                        progress.still(case_id, time.monotonic() - since, death.stage(log))
                for rec in ended:
                    held_for_the_end(rec)
                    if w.gpu is not None:  # the GPU its worker was pinned to (CUDA_VISIBLE_DEVICES)
                        rec.environment = {**rec.environment, "gpu": w.gpu}
                    append_jsonl(results_path, rec)
                    done[rec.id] = rec
                    progress.finish(rec)
                if not w.pending:
                    active.remove(w)
                    free_gpus.extend(w.held)
    finally:
        for w in active:  # interrupted: leave no worker behind
            w.proc.kill()
        for w in active:  # reaped and its pipe closed, not left to multiprocessing's exit handler
            w.proc.join()
            w.conn.close()
        with contextlib.suppress(OSError):  # only when empty: an interrupted case's file waits for --resume
            (run_dir / KEPT_DIR).rmdir()
        if own:
            progress.close()
    return [done[c.id] for c in cases if c.id in done]


def _slots(lone: bool, active: list[_Worker], free: list[str], slots: dict[str, int]) -> list[str] | None:
    """The GPU slots a worker takes now (``slots``: each GPU's, ``free``: those not taken): one of a GPU, or every
    slot of a GPU for a case that runs alone; [] with no GPUs to pin (one GPU, or a device the cases name), where a
    case that runs alone waits for the others to end and they for it; None when it must wait."""
    if not slots:
        return None if any(w.alone for w in active) or (lone and active) else []
    for g in dict.fromkeys(free):
        if not lone:
            return [g]
        if free.count(g) == slots[g]:
            return [g] * slots[g]
    return None


PRELIMINARY = ("pass", "unsupported", "skipped")  # what the run's analysis may still turn into a failure


def held_for_the_end(rec: CaseResult) -> None:
    """Mark the worker's record of a case whose check judges at the end (``Check.judged_at_end``) as not yet its
    verdict: its progress line says "ran (judged at the end)", and results.jsonl holds it so (``judged_later``)
    until the finished run replaces it with the final record. A check that knows a record is final says so
    (``judged_later: False``: paths' reference cases)."""
    from kvdiag.checks.registry import get

    check = get(rec.check)
    if rec.status in PRELIMINARY and check is not None and check.judged_at_end:
        rec.metrics.setdefault("judged_later", True)
