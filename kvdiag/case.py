"""A case and what a worker gives its case function: the lowest layer of running cases (docs/DESIGN.md, "Running
cases"). The runner (kvdiag/run/runner.py) runs cases in workers (kvdiag/run/worker.py); both, the checks and the
progress lines build on this module, which imports none of them.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvdiag.results import CaseResult

LOG_TAIL_CHARS = 4000
STAGE_MARK = "--- kvdiag stage: "  # a line in the case log: where the case is (a worker that dies names it)
REPRODUCE_MARK = "--- kvdiag reproduce: "  # a line in the case log: a command that repeats the engine's start
FIRED_MARK = "--- kvdiag fault fired: "  # a line in the case log: a re-introduced fault ran (said before a crash)
KEPT_DIR = "kept"  # in the run directory: what each running case has measured so far (WorkerContext.keep)
PROGRESS_S = float(os.environ.get("KVDIAG_PROGRESS_S", "10"))  # most seconds a running case goes unsaid


@dataclass
class Case:
    check: str
    engine: str
    model: str
    kv_dtype: str
    target: str | None = None  # None: the worker runs the check's ``run``, found by ``check`` in the registry;
    # else "package.module:function", called as function(case, ctx) (the self-test's wrapper, the runner's tests)
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
    send: Callable | None = None  # to the parent (the worker's pipe)

    def progress(self, case: Case, text: str) -> None:
        """A line of progress inside a long case ("120/400 documents, 35 doc/s"), shown under its id."""
        if self.send is not None:
            self.send(("progress", (case.id, text)))

    def stage(self, case: Case, name: str) -> None:
        """Mark in the case log that ``case`` enters ``name`` ("engine start", "lm_eval", ...): a worker that dies
        there (SIGABRT after a CUDA error) is recorded with the stage it died in."""
        print(f"{STAGE_MARK}{name} ({case.id}) ---", flush=True)

    def artifact(self, case: Case, suffix: str) -> Path:
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        return self.artifacts_dir / f"{safe_name(case.id)}{suffix}"

    def keep(self, case: Case, stage: str, **metrics) -> None:
        """Say that ``case`` finished ``stage`` and measured ``metrics`` (JSON values; nested dicts such as
        ``artifacts`` and ``timings`` merge with what earlier stages kept). Written to a file of the run directory
        at once, so that a worker that dies later (a segfault in native code) leaves it: the runner merges it into
        the crashed or timed-out case's record (``take_kept``). A case that returns its record drops it."""
        path = kept_path(self.run_dir, case.id)
        got = _read_kept(path) or {"finished": [], "metrics": {}}
        got["finished"].append(stage)
        _merge(got["metrics"], metrics)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(got, default=str))
        os.replace(tmp, path)  # whole or not at all: the worker may die at any moment


def kept_path(run_dir: Path, case_id: str) -> Path:
    return Path(run_dir) / KEPT_DIR / f"{safe_name(case_id)}.json"


def take_kept(run_dir: Path, case_id: str) -> dict | None:
    """What ``case_id`` kept (``WorkerContext.keep``): ``{"finished": [stage, ...], "metrics": {...}}``, or None;
    the file is removed."""
    path = kept_path(run_dir, case_id)
    got = _read_kept(path)
    path.unlink(missing_ok=True)
    return got


def add_kept(rec: CaseResult, kept: dict | None) -> str:
    """Put what a case kept before it died into its record's metrics (its own metrics win), with the stages it
    finished as ``finished_stages``; returns what to add to the finding's message ("" when nothing was kept)."""
    if not kept or not kept.get("finished"):
        return ""
    rec.metrics = {**kept.get("metrics", {}), **rec.metrics, "finished_stages": kept["finished"]}
    return f"; kept what it measured before: {', '.join(dict.fromkeys(kept['finished']))}"


def _read_kept(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _merge(into: dict, more: dict) -> None:
    for k, v in more.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


_NOTES = threading.local()  # what code below the checks has to say about the case running on this thread


def engine_note(kind: str, message: str, **evidence) -> None:
    """An info finding for the case running on this thread, from code below the checks (an engine working around a
    known incompatibility at its start); the worker adds it to the case's record (``take_engine_notes``)."""
    print(f"kvdiag: {message}", file=sys.stderr, flush=True)
    _NOTES.items = [*getattr(_NOTES, "items", []), (kind, message, evidence)]


def take_engine_notes() -> list[tuple[str, str, dict]]:
    """The notes given on this thread since the last call, (kind, message, evidence) each; clears them."""
    items, _NOTES.items = getattr(_NOTES, "items", []), []
    return items


def safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_")


def call_target(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


SHARE_CORES = "KVDIAG_SHARE_CORES"


def share_cores(env: dict, jobs: int, left: int) -> dict:
    """With ``KVDIAG_SHARE_CORES=N`` in ``env``, a worker's torch threads: N shared by the workers that can still
    run at once, ``min(jobs, groups not started yet, its own included)``; the last groups of a sweep get the cores
    the finished ones freed (7 dtypes on 2 single-thread workers: the 7th runs alone with 2 threads)."""
    if SHARE_CORES not in env:
        return env
    return {**env, "OMP_NUM_THREADS": str(max(1, int(env[SHARE_CORES]) // max(1, min(jobs, left))))}


