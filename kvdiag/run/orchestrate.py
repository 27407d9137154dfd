"""Running a command's cases: the run directory, the environment record, execute (run, analyse, write run.json,
print, exit code)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from kvdiag.errors import UserError


def make_run_dir(output_dir: Path | None, command: str, resume: Path | None = None) -> Path:
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise UserError(f"--resume: run directory not found: {run_dir}")
        if output_dir is not None and Path(output_dir).resolve() != run_dir.resolve():
            raise UserError(f"--resume {run_dir} with --output-dir {output_dir}: a resumed run stays in its "
                            "directory")
    elif output_dir is not None:
        run_dir = Path(output_dir)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path("reports") / f"{stamp}-{command}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UserError(f"output directory '{run_dir}' is not writable: {e.strerror or e}") from None
    return run_dir


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment() -> dict:
    """Versions (kvdiag's and its git commit), devices, without importing torch or initialising CUDA in kvdiag's
    own process."""
    from kvdiag.run.provenance import kvdiag_git
    from kvdiag.version import __version__

    git = kvdiag_git()
    env = {
        "kvdiag": __version__,
        "kvdiag_commit": git["commit"],  # None unless kvdiag runs from a git checkout
        "kvdiag_dirty": git["dirty"],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    from kvdiag.engines.base import engine_distributions

    for dist in ("torch", "triton", "transformers", "lm_eval", *engine_distributions()):
        v = _version(dist)
        if v:
            env[dist.replace("-", "_")] = v
    env.update(_nvml_devices())
    return env


def _nvml_devices() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVIDIA driver: a CPU machine
        return {"device": "cpu", "driver": None}
    try:
        n = pynvml.nvmlDeviceGetCount()
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
        names = [x.decode() if isinstance(x, bytes) else x for x in names]
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {"device": ", ".join(names) or "cpu", "gpu_count": n,
                "driver": driver.decode() if isinstance(driver, bytes) else driver}
    finally:
        pynvml.nvmlShutdown()


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    return "kvdiag " + " ".join(shlex.quote(a) for a in sys.argv[1:])



def execute(command: str, cases: list, run_dir: Path, *, fmt, render: Callable | None = None, **kw) -> int:
    """:func:`record`, printed as ``fmt`` says (``render``: the table, default the check's own), and its exit code
    (0 pass, 1 failed). ``command``: what the cases are of, for a reader of the call."""
    return record(cases, run_dir, fmt=fmt, render=render, **kw).exit_code


def record(
    cases: list,
    run_dir: Path,
    *,
    timeout: float,
    fmt=None,
    resume: bool = False,
    quiet: bool = False,
    jobs: int = 1,
    env: dict | None = None,
    analyze: Callable | None = None,
    render: Callable | None = None,
    finish: Callable | None = None,
    preload: tuple[str, ...] | None = None,
    threads: int = 1,
    command: str | None = None,
    durations: dict[str, float] | None = None,
    call: dict | None = None,
    prove: bool = False,
    strict: bool = False,
):
    """Run cases, analyse, write run.json, print as ``fmt`` says ("table", "json", None: nothing), return the
    finished run (a RunRecord). ``threads``: see :func:`kvdiag.run.runner.run_cases`. ``jobs`` is capped at one
    case per GPU when cases run on GPUs, each worker given its own, and cases of an engine that allows one engine
    per process on a GPU each get a worker of their own there (:mod:`kvdiag.run.scheduling`).

    ``finish(run)`` (optional) runs on the finished run before run.json is written: it may add to
    run.analysis, set run.exit_code (which is first derived from the case statuses) and write reports.

    ``preload`` None (every command's default): the workers fork from a server that imported what the cases'
    engine and checks need, and their environment starts from ``scheduling.worker_setup`` (``env`` on top); a
    caller that must keep process state apart (the builtin self-test's faults) passes ``()``. ``command``: what run.json
    says was run (default: this process's kvdiag command line). ``durations``: an earlier run's case times, to start the
    longest cases first (:func:`kvdiag.run.runner.run_cases`). ``call``: what run.json records the run was made
    with (``kvdiag.run.resume``); with ``resume`` the cases must be the recorded run's (UserError, before any worker).
    ``prove``: each failing case's reproducer is written and run once the run is judged (``kvdiag.proof``);
    ``strict``: one that does not reproduce is an error of its case, not a warning.
    """
    from kvdiag.results import RunRecord, exit_code_for, summarize, write_jsonl, write_run_json
    from kvdiag.run.progress import make_progress
    from kvdiag.run.provenance import models_record
    from kvdiag.run.resume import jsonable, plan, same_plan
    from kvdiag.run.runner import run_cases
    from kvdiag.run.scheduling import cap_jobs, own_workers, place, worker_setup

    fmt = getattr(fmt, "value", fmt)
    cases = own_workers(cases)  # vLLM on CUDA: one engine per process, whatever --isolate asked
    jobs, gpus = cap_jobs(cases, jobs, quiet=quiet)
    if preload is None:
        preload, setup = worker_setup(cases, jobs)
        env = {**setup, **(env or {})}
    started = now()
    previous = _previous_run(run_dir) if resume else None
    run = RunRecord(command=previous.command if previous else command or command_line(),
                    started=previous.started if previous else started,
                    cases=[], environment=environment(), run_dir=str(run_dir),
                    models=models_record(c.model for c in cases),
                    call=previous.call if previous and previous.call else call and jsonable(call),
                    plan=same_plan(run_dir, cases) if resume else plan(cases))
    write_run_json(run_dir, run)  # a run directory always says what it is, even if killed
    quiet = quiet or fmt == "json" and not sys.stderr.isatty()
    progress = make_progress(len(cases), quiet)
    try:
        run.cases = run_cases(cases, run_dir, timeout=timeout, resume=resume, quiet=quiet, jobs=jobs, env=env,
                              preload=preload, threads=threads, gpus=gpus, durations=durations,
                              alone=place(cases).alone, progress=progress)
        if analyze is not None:
            analyze(run)  # may update case statuses and findings, and fills run.analysis
        for c in run.cases:
            if c.metrics.pop("judged_later", None):
                progress.judged(c)
    finally:
        progress.close()
    if prove:
        from kvdiag.run.prove import prove_run

        prove_run(run, say=None if quiet else lambda line: print(line, file=sys.stderr, flush=True), jobs=jobs,
                  strict=strict)
    write_jsonl(run_dir / "results.jsonl", run.cases)  # one final record per case
    run.summary = summarize(run.cases)
    run.exit_code = exit_code_for(run.cases)
    run.finished = now()
    if finish is not None:
        finish(run)
    write_run_json(run_dir, run)
    if fmt == "json":
        print(json.dumps(run.to_json(), indent=2))
    elif fmt is not None:
        from kvdiag.report.table import print_run

        print_run(run, render)
    return run


def _previous_run(run_dir: Path):
    from kvdiag.results import RunRecord

    path = Path(run_dir) / "run.json"
    try:
        return RunRecord.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
