"""kvdiag as a library: :func:`run_check` runs one check the way its command does and returns the finished run.
Every check command (accuracy, dtypes --check, memleak, wake-cycle, poison, a plug-in's) is a thin wrapper around
it, so a notebook, a CI script and the command line get the same cases, the same run directory and the same verdict.

    import kvdiag
    run = kvdiag.run_check("accuracy", kv_dtypes=["auto", "fp8"], limit=20)
    run.exit_code, run.summary, run.analysis["accuracy"]["rows"]
    from kvdiag.results import scores_frame
    scores_frame(run)

Bad input raises :class:`kvdiag.errors.UserError` before any worker starts (the command prints its one line and
exits 2).
"""

from __future__ import annotations

from pathlib import Path

from kvdiag.errors import UserError


def run_check(check: str, *, engine: str = "builtin", model: str | None = None,
              kv_dtypes: list[str] | None = None, device: str = "auto", engine_args: dict | list[str] | None = None,
              faults: list[str] | None = None, isolate: str = "case", output_dir: str | Path | None = None,
              jobs: int | None = None, timeout: float | None = None, resume: str | Path | None = None,
              quiet: bool = False, fmt: str | None = None, command: str | None = None,
              given: set[str] | None = None, prove: bool | None = None, strict: bool = False, **options):
    """Run ``check`` (a registered check's name: ``kvdiag.checks.registry.checks()``) and return its finished run
    (:class:`kvdiag.results.RunRecord`: ``cases``, ``analysis``, ``summary``, ``exit_code``, ``run_dir``).

    ``engine``, ``model`` (None: the shipped tiny model), ``kv_dtypes`` (None: every dtype the engine supports),
    ``device``, ``engine_args`` (``{"key": value}`` or ``["key=value"]``: the command's ``-a``), ``faults`` (the
    builtin engine's), ``isolate`` ("case" or "run"), ``output_dir`` (None: ``reports/STAMP-CHECK``), ``jobs``
    (None: the command's default), ``timeout`` (seconds a case may run; None: the check's), ``resume`` (a run
    directory to finish) are what every check command takes; ``options`` are the check's own (its params' field
    names: ``limit=20``, ``cycles=2``, ``levels=[1, 2]``). ``quiet`` silences progress on stderr; ``fmt`` "table" or
    "json" prints the run as the command does (None: prints nothing); ``command`` is what run.json says was run
    (default: this call; a command passes its command line). report.md and report.html are written into the run
    directory.

    ``prove``: each failing case's standalone reproducer (``RUN_DIR/repro/CASE.py``, where kvdiag can write one) is
    run in a fresh process after the run, and the case says whether it reproduced (``kvdiag.proof``); None: yes,
    unless ``KVDIAG_PROVE=0``. ``strict``: a failure whose reproducer did not reproduce is an error of the case, not
    a warning (and, for a check that takes ``--strict`` itself, accuracy's, that option too).

    ``resume``: the run goes on with the engine, model, dtypes and options it was made with (run.json's ``call``);
    an argument given again must equal the run's (``given``: the names of those given; default: the arguments that
    differ from this function's defaults, and every check option passed), else UserError.
    """
    from kvdiag.checks.cases import Target
    from kvdiag.checks.registry import check_cases, checks, get
    from kvdiag.proof.runs import prove_default
    from kvdiag.report import write_reports
    from kvdiag.run.orchestrate import make_run_dir, record
    from kvdiag.run.scheduling import case_threads, default_jobs, gpu_jobs

    found = get(check)
    if found is None:
        raise UserError(f"unknown check '{check}'; valid: {', '.join(checks())}")
    if isinstance(engine_args, dict):
        engine_args = [f"{k}={_arg(v)}" for k, v in engine_args.items()]
    if strict and "strict" in {f.name for f in found.option_fields()}:
        options = {**options, "strict": True}
    call = {"check": found.name, "engine": engine, "model": model, "kv_dtypes": kv_dtypes, "device": device,
            "engine_args": engine_args, "faults": faults, "isolate": getattr(isolate, "value", isolate),
            "options": options}
    if resume is not None:
        from kvdiag.run.resume import resumed_call

        if given is None:
            given = {k for k, v in call.items() if k != "options" and v != DEFAULTS.get(k)} | set(options)
        call = resumed_call(Path(resume), call, set(given), lambda name: _flag(found, name))
        engine, model, kv_dtypes, device, engine_args, faults, isolate, options = (
            call[k] for k in ("engine", "model", "kv_dtypes", "device", "engine_args", "faults", "isolate", "options"))
    p = found.make(_options(found, options))
    target = Target(engine, model, list(kv_dtypes) if kv_dtypes else None, device, engine_args, faults, isolate)
    cases, analyze = check_cases(found.name, target, p)
    run_dir = make_run_dir(Path(output_dir) if output_dir is not None else None, found.name,
                           Path(resume) if resume is not None else None)
    if jobs is None:
        jobs = default_jobs(cases) if found.gpu_share else gpu_jobs(cases)
    threads = case_threads(cases, isolate, jobs) if found.gpu_share else 1
    return record(cases, run_dir, timeout=found.timeout if timeout is None else timeout, resume=resume is not None,
                  quiet=quiet, fmt=fmt, jobs=jobs, analyze=analyze, threads=threads, call=call,
                  prove=prove_default() if prove is None else prove,
                  strict=strict or bool(getattr(p, "strict", False)),
                  finish=lambda run: write_reports(run, run_dir, ("md", "html")),
                  command=command or _call_text(check, engine, model, kv_dtypes, engine_args, options))


DEFAULTS = {"engine": "builtin", "device": "auto", "isolate": "case"}  # run_check's, where not None


def _flag(check, name: str) -> str:
    """The command-line flag of a run_check argument or of one of the check's options."""
    from dataclasses import fields

    from kvdiag.run.resume import FLAGS

    if name in FLAGS:
        return FLAGS[name]
    f = next((f for f in fields(check.params) if f.name == name), None)
    flags = f.metadata.get("flags") if f is not None else None
    return (flags or (f"--{name.replace('_', '-')}",))[0]


def _options(check, given: dict) -> dict:
    """``given`` checked as the config checks a check's table: every key one of its params' fields, each option's
    value of its type and within its bounds or choices; else UserError naming what is wrong."""
    import typing
    from dataclasses import fields

    from kvdiag.checks.registry import validator
    from kvdiag.engines.base import close_names

    hints = typing.get_type_hints(check.params)
    by_name = {f.name: f for f in fields(check.params)}
    out = {}
    for key, value in given.items():
        f = by_name.get(key)
        if f is None:
            near = close_names(key, list(by_name))
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise UserError(f"'{key}' is not an option of check '{check.name}'{hint}; valid: {', '.join(by_name)}")
        try:
            out[key] = validator(f, hints[key])(value) if "flags" in f.metadata and value is not None else value
        except ValueError as e:
            flag = (f.metadata["flags"] or (f"--{key.replace('_', '-')}",))[0]
            cli = " ".join(f"{flag} {v}" for v in (value if isinstance(value, list) else [value]))
            raise UserError(f"check '{check.name}': {key}={value!r} ({cli}): expected {e}") from None
    return out


def _call_text(check, engine, model, kv_dtypes, engine_args, options) -> str:
    """What run.json says was run, for a library call: the call, with the arguments that choose the cases."""
    given = {"engine": engine, "model": model, "kv_dtypes": kv_dtypes, "engine_args": engine_args, **options}
    shown = ", ".join(f"{k}={v!r}" for k, v in given.items()
                      if v is not None and not (k == "engine" and v == "builtin"))
    return f"kvdiag.run_check({check!r}" + (f", {shown}" if shown else "") + ")"


def _arg(v) -> str:
    """An ``-a`` value as the command line spells it (JSON for lists and tables: ``keyvalue`` parses it back)."""
    import json

    return json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else str(v)
