"""`kvdiag accuracy`: lm_eval per kv dtype + token-level drift, paired statistics against a baseline dtype."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.checks.accuracy import AccuracyParams
from kvdiag.cli import options as o

A = AccuracyParams
TasksOpt = o.field_option(A, "tasks")
IncludeOpt = o.field_option(A, "include_paths", list[Path])
BaselineOpt = o.field_option(A, "baseline")
LimitOpt = o.field_option(A, "limit")
FewshotOpt = o.field_option(A, "num_fewshot")
MaxDropOpt = o.field_option(A, "max_drop")
AlphaOpt = o.field_option(A, "alpha")
StrictOpt = o.field_option(A, "strict")
MaxKLOpt = o.field_option(A, "max_kl")
MinTop1Opt = o.field_option(A, "min_top1")
DecodedOpt = o.field_option(A, "drift_decoded")
BatchOpt = o.field_option(A, "batch_size")
ChatOpt = o.field_option(A, "apply_chat_template")
MultiturnOpt = o.field_option(A, "fewshot_as_multiturn")
SystemOpt = o.field_option(A, "system_instruction")
GenKwargsOpt = o.field_option(A, "gen_kwargs")
MetadataOpt = o.field_option(A, "metadata")
NeedleOpt = o.field_option(A, "needle_lengths")




def accuracy(
    ctx: typer.Context,
    engine: o.EngineOpt = "builtin",
    model: o.ModelOpt = None,
    kv_dtype: o.KVDtypeOpt = None,
    baseline: BaselineOpt = A.baseline,
    tasks: TasksOpt = None,
    include_path: IncludeOpt = None,
    needle_length: NeedleOpt = None,
    limit: LimitOpt = None,
    num_fewshot: FewshotOpt = None,
    seed: o.SeedOpt = A.seed,
    batch_size: BatchOpt = A.batch_size,
    apply_chat_template: ChatOpt = None,
    fewshot_as_multiturn: MultiturnOpt = None,
    system_instruction: SystemOpt = None,
    gen_kwargs: GenKwargsOpt = None,
    metadata: MetadataOpt = None,
    max_drop: MaxDropOpt = A.max_drop,
    alpha: AlphaOpt = A.alpha,
    strict: StrictOpt = A.strict,
    max_kl: MaxKLOpt = None,
    min_top1: MinTop1Opt = None,
    drift_decoded: DecodedOpt = A.drift_decoded,
    isolate: o.IsolateOpt = o.Isolate.case,
    jobs: o.SweepJobsOpt = None,
    device: o.DeviceOpt = "auto",
    engine_arg: o.EngineArgOpt = None,
    output_dir: o.OutputDirOpt = None,
    fmt: o.FormatOpt = o.Format.table,
    timeout: o.TimeoutOpt = 900.0,
    resume: o.ResumeOpt = None,
    quiet: o.QuietOpt = False,
    prove: o.ProveOpt = True,
    fault: o.FaultOpt = None,
) -> None:
    """Score lm_eval tasks and token-level drift for each kv dtype against a baseline dtype.

    Each dtype gets score ± stderr per task metric, the change against the baseline on the
    same documents (exact McNemar for 0/1 metrics, paired bootstrap otherwise) with a 95%
    interval and p-value, the smallest drop its documents detect with power 0.8, and a verdict: ok,
    inconclusive (a drop that is not significant, or one the run could not have seen: with the documents that
    would settle it), regression, collapse or drift. Exit code 1 when any dtype regressed, collapsed, drifted or
    crashed (or, with --strict, was inconclusive).

    lm_eval's spellings work too: --model_args (= -a), --num_fewshot, --batch_size, --output_path (= -o),
    --gen_kwargs, --apply_chat_template, --fewshot_as_multiturn, --system_instruction, --include_path.
    """
    from kvdiag.api import run_check
    from kvdiag.run.orchestrate import command_line

    run = run_check("accuracy", engine=engine, model=model, kv_dtypes=kv_dtype, device=device, engine_args=engine_arg,
                    faults=fault, isolate=isolate, output_dir=output_dir, jobs=jobs, timeout=timeout, resume=resume,
                    quiet=quiet, fmt=fmt, prove=prove, command=command_line(), given=o.given(ctx), tasks=tasks or [],
                    include_paths=[str(x) for x in include_path or ()], needle_lengths=needle_length or [],
                    baseline=baseline, limit=limit, num_fewshot=num_fewshot, seed=seed, batch_size=batch_size,
                    apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
                    system_instruction=system_instruction, gen_kwargs=gen_kwargs, metadata=metadata,
                    max_drop=max_drop, alpha=alpha, max_kl=max_kl, min_top1=min_top1, strict=strict,
                    drift_decoded=drift_decoded)
    raise typer.Exit(run.exit_code)
