"""`kvdiag memleak`: memory across create / generate / shutdown cycles, with the holders of what leaked."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvdiag.cli.options import (
    CyclesOpt,
    DeviceOpt,
    EngineArgOpt,
    EngineOpt,
    FaultOpt,
    Format,
    FormatOpt,
    JobsOpt,
    KVDtypeOpt,
    ModelOpt,
    OutputDirOpt,
    QuietOpt,
    ResumeOpt,
    TimeoutOpt,
)

ThresholdOpt = Annotated[Optional[float], typer.Option(
    "--threshold", help="Retention limit: MiB that may stay held beyond the baseline after any shutdown (CUDA "
    "allocated/reserved, live tensor bytes; the driver's used memory and NVML get 128 MiB more for the CUDA "
    "runtime's own memory). Default: max(64 MiB, 5% of the engine's peak).", min=0)]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="Tokens decoded per prompt in each cycle.", min=1)]

COLUMNS = (("cycle", "cycle"), ("stage", "stage"), ("tensors", "tensors"), ("tensor_mib", "tensor MiB"),
           ("rss_mib", "RSS MiB"), ("cuda_allocated_mib", "CUDA alloc"), ("cuda_reserved_mib", "CUDA reserved"),
           ("driver_used_mib", "driver used"), ("nvml_process_mib", "NVML proc"), ("frozen", "frozen"))


def memleak(
    engine: EngineOpt = "builtin",
    model: ModelOpt = None,
    kv_dtype: KVDtypeOpt = None,
    cycles: CyclesOpt = 3,
    threshold: ThresholdOpt = None,
    max_tokens: MaxTokensOpt = 16,
    jobs: JobsOpt = 1,
    device: DeviceOpt = "auto",
    engine_arg: EngineArgOpt = None,
    output_dir: OutputDirOpt = None,
    fmt: FormatOpt = Format.table,
    timeout: TimeoutOpt = 900.0,
    resume: ResumeOpt = None,
    quiet: QuietOpt = False,
    fault: FaultOpt = None,
) -> None:
    """Is memory back after the engine shuts down? Per kv dtype, in a fresh worker: a baseline, then
    --cycles times start, a short prefill + decode, snapshot, shutdown, gc + empty_cache, snapshot.

    One verdict policy for every engine. FAIL when:
    retention - after any shutdown (the first too; one cycle is enough) more than --threshold MiB stays held
    beyond the baseline on CUDA allocated/reserved, the driver's used memory or live tensor bytes; the
    finding names the holder: Python referrers (a module global, an lru_cache and its key, a closure, a class
    attribute, the engine object), vLLM's sleep-mode allocator pool, CUDA graph pools, or "held outside
    Python objects (allocator/driver)";
    growth - memory after shutdown grows in every step from one cycle to the next: by more than 4 MiB on
    tensor bytes, CUDA allocated or reserved, by more than max(16 MiB, 1% of the peak) on RSS, driver
    used and NVML;
    surviving tensors whose count or bytes grow every cycle;
    restart impossible - the engine started once and cannot start again in this process (vLLM sleep mode
    on CUDA), with the engine's message;
    objects left frozen by gc.freeze().
    WARNING (exit 0): a small set of tensors that survives shutdown unchanged every cycle (a process-lifetime
    cache), with its holder. INFO: a one-time cost of the first cycle under the limits.
    """
    from kvdiag.cli.common import execute, make_run_dir

    cases = build_cases(engine, model, kv_dtype, device, engine_arg, fault, cycles=cycles, threshold=threshold,
                        max_tokens=max_tokens)
    run_dir = make_run_dir(output_dir, "memleak", resume)
    code = execute("memleak", cases, run_dir, fmt=fmt, timeout=timeout, resume=resume is not None, quiet=quiet,
                   jobs=jobs, render=render)
    raise typer.Exit(code)


def build_cases(engine, model, kv_dtype, device, engine_arg, fault, *, cycles=3, threshold=None,
                max_tokens=16) -> list:
    """The memleak cases (also used by `kvdiag ci`); every dtype always gets its own worker."""
    from kvdiag.cli.common import dtype_cases

    params = {"cycles": cycles, "threshold_mib": threshold, "max_tokens": max_tokens}
    return dtype_cases("memleak", "kvdiag.checks.memleak:run", engine, model, kv_dtype, device, engine_arg, fault,
                       params)


def render(run, con) -> None:
    """One table of dtype x cycle x stage, then the findings (holders with their chains)."""
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.report.table import fmt_value, status_text

    t = Table(title="memleak: memory per kv dtype, cycle and stage", title_justify="left")
    for col in ("kv dtype", "status") + tuple(label for _, label in COLUMNS):
        t.add_column(col, justify="left" if col in ("kv dtype", "status", "stage") else "right")
    for c in run.cases:
        rows = c.metrics.get("snapshots") or [{}]
        for i, row in enumerate(rows):
            t.add_row(c.kv_dtype if i == 0 else "", status_text(c.status) if i == 0 else "",
                      *[fmt_value(row.get(key)) for key, _ in COLUMNS], end_section=i == len(rows) - 1)
    con.print(t)
    for c in run.cases:
        th = c.metrics.get("threshold_mib")
        head = f"[bold]{c.kv_dtype}[/] ({status_text(c.status)}" + (f", threshold {th:.1f} MiB)" if th else ")")
        shown = [f for f in c.findings if f.kind != "one_time_cost" or c.status == "pass"]
        if not shown:
            continue
        con.print(head)
        for f in shown:
            con.print(f"  {f.severity}: {f.kind}: {escape(f.message)}")
            if f.evidence.get("path") and f.evidence["path"] != "?":
                con.print(f"    path: {escape(f.evidence['path'])}")
