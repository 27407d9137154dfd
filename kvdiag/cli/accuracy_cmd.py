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
MaxKLOpt = o.field_option(A, "max_kl")
MinTop1Opt = o.field_option(A, "min_top1")
BatchOpt = o.field_option(A, "batch_size")
ChatOpt = o.field_option(A, "apply_chat_template")
MultiturnOpt = o.field_option(A, "fewshot_as_multiturn")
SystemOpt = o.field_option(A, "system_instruction")
GenKwargsOpt = o.field_option(A, "gen_kwargs")
MetadataOpt = o.field_option(A, "metadata")




def accuracy(
    engine: o.EngineOpt = "builtin",
    model: o.ModelOpt = None,
    kv_dtype: o.KVDtypeOpt = None,
    baseline: BaselineOpt = A.baseline,
    tasks: TasksOpt = None,
    include_path: IncludeOpt = None,
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
    max_kl: MaxKLOpt = None,
    min_top1: MinTop1Opt = None,
    isolate: o.IsolateOpt = o.Isolate.case,
    jobs: o.SweepJobsOpt = None,
    device: o.DeviceOpt = "auto",
    engine_arg: o.EngineArgOpt = None,
    output_dir: o.OutputDirOpt = None,
    fmt: o.FormatOpt = o.Format.table,
    timeout: o.TimeoutOpt = 900.0,
    resume: o.ResumeOpt = None,
    quiet: o.QuietOpt = False,
    fault: o.FaultOpt = None,
) -> None:
    """Score lm_eval tasks and token-level drift for each kv dtype against a baseline dtype.

    Each dtype gets score ± stderr per task metric, the change against the baseline on the
    same documents (exact McNemar for 0/1 metrics, paired bootstrap otherwise) with a 95%
    interval and p-value, and a verdict: ok, regression, collapse or drift. Exit code 1 when
    any dtype regressed, collapsed, drifted or crashed.

    lm_eval's spellings work too: --model_args (= -a), --num_fewshot, --batch_size, --output_path (= -o),
    --gen_kwargs, --apply_chat_template, --fewshot_as_multiturn, --system_instruction, --include_path.
    """
    from kvdiag.run.cases import Target, check_cases
    from kvdiag.run.orchestrate import execute, make_run_dir
    from kvdiag.run.scheduling import case_threads, default_jobs

    p = A(tasks=tasks or [], include_paths=include_path or [], baseline=baseline, limit=limit,
          num_fewshot=num_fewshot, seed=seed, batch_size=batch_size, apply_chat_template=apply_chat_template,
          fewshot_as_multiturn=fewshot_as_multiturn, system_instruction=system_instruction, gen_kwargs=gen_kwargs,
          metadata=metadata, max_drop=max_drop, alpha=alpha, max_kl=max_kl, min_top1=min_top1)
    target = Target(engine, model, kv_dtype, device, engine_arg, fault, isolate)
    cases, analyze = check_cases("accuracy", target, p)
    run_dir = make_run_dir(output_dir, "accuracy", resume)
    jobs = jobs or default_jobs(cases)
    code = execute("accuracy", cases, run_dir, fmt=fmt, timeout=timeout, resume=resume is not None, quiet=quiet,
                   jobs=jobs, analyze=analyze,
                   threads=case_threads(cases, isolate, jobs), finish=reports_into(run_dir))
    raise typer.Exit(code)




def reports_into(run_dir: Path):
    """The finished run's report.md and report.html (every task and metric; plots) in its run directory, as the
    table's last line says."""
    def finish(run) -> None:
        from kvdiag.report import write_reports

        write_reports(run, run_dir, ("md", "html"))

    return finish
