"""Options shared by every command, as Annotated aliases: each command names them the same."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvdiag.engines.base import args_example


class Format(str, Enum):
    table = "table"
    json = "json"


class Isolate(str, Enum):
    case = "case"
    run = "run"


EngineOpt = Annotated[str, typer.Option(
    "--engine", "-e", help="Engine: builtin (embedded, torch only), vllm, a name registered under the "
    "'kvdiag.engines' entry point, or package.module:factory.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Model folder, or hub id (gpt2, org/name) taken from the Hugging Face cache or "
    "downloaded once, before any worker starts. Default: kvdiag's shipped tiny model.")]


def kv_dtype_option(default: str):
    """--kv-dtype/-d, whose default (said in its help) is ``default``."""
    return Annotated[Optional[list[str]], typer.Option(
        "--kv-dtype", "-d", help="kv-cache dtype; repeat for several. Short aliases work (bf16, fp16, int8, fp8pth). "
        f"Default: {default}.")]


KVDtypeOpt = kv_dtype_option("every dtype the engine supports")
OutputDirOpt = Annotated[Optional[Path], typer.Option(
    "--output-dir", "-o", help="Run directory for results.jsonl, run.json and reports. "
    "Default: reports/<timestamp>-<command>/.")]
FormatOpt = Annotated[Format, typer.Option(
    "--format", "-f", help="table: a table for people (progress on stderr); json: the run record on stdout only.")]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", help="Seconds one case may run before its worker is killed and the case recorded as timeout.",
    min=1)]
ResumeOpt = Annotated[Optional[Path], typer.Option(
    "--resume", help="Continue the run in RUN_DIR with its own options (run.json): the cases it has not recorded "
    "run; an option given again must be the run's (else exit 2).")]
# a command's option names where run_check's differ (kvdiag.api.run_check)
CALL_NAMES = {"kv_dtype": "kv_dtypes", "engine_arg": "engine_args", "fault": "faults", "include_path": "include_paths",
              "needle_length": "needle_lengths"}


def given(ctx) -> set[str]:
    """The options the command line (or the environment) gave the command of ``ctx`` (its ``typer.Context``), as
    run_check names them: what --resume holds to the run's own options."""
    said = ("COMMANDLINE", "ENVIRONMENT")
    return {CALL_NAMES.get(n, n) for n in ctx.params if getattr(ctx.get_parameter_source(n), "name", "") in said}


QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]
ProveOpt = Annotated[bool, typer.Option(
    "--prove/--no-prove", envvar="KVDIAG_PROVE", help="Write each failing case's reproducer (RUN_DIR/repro/CASE.py: "
    "the engine alone: vLLM, or the builtin engine's own API, none of kvdiag's checks), run it in a fresh process "
    "and say whether it reproduces (up to 3 runs when it does not at once).")]
StrictOpt = Annotated[bool, typer.Option(
    "--strict", help="A failure whose reproducer did not reproduce outside kvdiag is an error of its case, not a "
    "warning (it may be kvdiag's own doing).")]
EngineArgOpt = Annotated[Optional[list[str]], typer.Option(
    "--engine-arg", "-a", help="key=value passed to the engine, several comma-separated as lm_eval's --model_args; "
    "values JSON-ish (2, 0.5, true, none, [1,2], \"a,b\"); repeatable; a name the engine does not take exits 2 with "
    f"the closest names; '-a help' lists the engine's. Example {args_example()}")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N (builtin engine).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed for sampling and for lm_eval.")]
CheckJobsOpt = Annotated[Optional[int], typer.Option(
    "--jobs", "-j", min=1, help="Cases run at once (each in its own worker). Default: one per visible GPU when the "
    "cases run on GPUs (each worker pinned to its own), else 1.")]
SweepJobsOpt = Annotated[Optional[int], typer.Option(
    "--jobs", "-j", min=1, help="Cases run at once: with --isolate case each in its own worker; with --isolate "
    "run (accuracy, builtin engine on the CPU) on threads of the one worker. Default: for the builtin engine on a "
    "machine without a GPU up to 4, at most the CPU cores (split among them; the last cases of a sweep get the "
    "cores the finished ones freed), else 1. On GPUs at most one case per visible GPU.")]
IsolateOpt = Annotated[Isolate, typer.Option(
    "--isolate", help="case: every dtype in its own worker process; run: one worker process for all dtypes "
    "(weights loaded once; accuracy with the builtin engine on the CPU runs --jobs dtypes at a time there, each "
    "with its own KV cache; a crash ends the dtypes running and those after it). run saves a worker start, an "
    "engine start and a weight load per dtype, worth what those cost with your model and device; with the "
    "shipped tiny model on the CPU both modes take the same time. vLLM on a GPU: always case (one vLLM engine per "
    "process).")]
CheckIsolateOpt = Annotated[Isolate, typer.Option(
    "--isolate", help="case: every dtype in its own worker process; run: one worker process runs the dtypes one "
    "after another (the weights load once; a crash ends the dtype running and those after it). vLLM on a GPU: "
    "always case (one vLLM engine per process).")]
FaultOpt = Annotated[Optional[list[str]], typer.Option(
    "--fault", help="Re-introduce a known bug class into the engine (see `kvdiag selftest [-e ENGINE] --list`).",
    hidden=True)]


def field_option(params: type, name: str, annotation=None):
    """The command-line option of a check's params field (kvdiag.checks.registry.option): its flags, help and bounds
    from the field, written once there; ``annotation`` overrides the type (an Enum for choices)."""
    import typing
    from dataclasses import fields

    f = next(x for x in fields(params) if x.name == name)
    meta = f.metadata
    hint = annotation or typing.get_type_hints(params)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list or (args and typing.get_origin(args[0]) is list):
        hint = Optional[hint if typing.get_origin(hint) is list else args[0]]
    elif type(None) in typing.get_args(hint):
        hint = Optional[args[0]]
    bounds = {k: meta[k] for k in ("min", "max") if meta.get(k) is not None}
    flags = meta.get("flags") or (f"--{name.replace('_', '-')}",)
    return Annotated[hint, typer.Option(*flags, help=meta.get("help") or None, **bounds)]
