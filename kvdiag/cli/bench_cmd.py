"""`kvdiag bench`: the builtin engine's Triton kernels against the memory-bandwidth limit and baselines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvdiag.cli.options import Format, FormatOpt, QuietOpt
from kvdiag.errors import UserError

OnlyOpt = Annotated[Optional[list[str]], typer.Option(
    "--only", help="Measure only these: store, decode, prefill, zero, engine; repeatable. Default: all.")]
QuickOpt = Annotated[bool, typer.Option(
    "--quick", help="Small sizes and a short engine run: a smoke test; targets are not judged.")]
BenchDeviceOpt = Annotated[str, typer.Option(
    "--device", help="cuda or cuda:N: the GPU to measure on (the Triton kernels run on CUDA only).")]
SaveOpt = Annotated[Optional[Path], typer.Option("--save", help="Also write the JSON record to this file.")]


def bench(
    fmt: FormatOpt = Format.table,
    only: OnlyOpt = None,
    quick: QuickOpt = False,
    device: BenchDeviceOpt = "cuda",
    save: SaveOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Time each Triton kernel x dtype x size: time, GB/s (bytes read + written), ratio to a device-to-device
    copy and to the baselines (torch reference, a (token, head)-grid store, SDPA over a gathered dequantized
    cache), all measured in the same run; plus builtin-engine decode tokens/s against transformers generate.

    Needs a CUDA GPU. Exit code 1 when a judged target (BENCHMARKS.md, "Targets") is missed.
    """
    from kvdiag.bench.run import KINDS

    kinds = tuple(only or KINDS)
    if bad := [k for k in kinds if k not in KINDS]:
        raise UserError(f"unknown --only value(s) {', '.join(bad)}; valid: {', '.join(KINDS)}")
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise UserError("kvdiag bench needs a CUDA GPU (the Triton kernels run on CUDA only); none is available"
                        if not torch.cuda.is_available() else f"kvdiag bench runs on cuda devices, not '{device}'")
    from kvdiag.bench.run import run_bench
    from kvdiag.render.cells import console

    err = console(stderr=True) if not quiet else None
    progress = (lambda m: err.print(f"[dim]bench: {m}[/dim]")) if err else None
    record = run_bench(kinds, "quick" if quick else "full", device, progress=progress)
    text = json.dumps(record, indent=2)
    if save:
        save.write_text(text + "\n")
    if fmt == Format.json:
        typer.echo(text)
    else:
        render(record, console())
    raise typer.Exit(0 if all(t["met"] for t in record["targets"]) else 1)


def _speedup(r: dict, name: str) -> str:
    b = r["baselines"].get(name)
    return f"{b['speedup']:.2f}x ({b['ms']:.3f} ms)" if b else "-"


def render(record: dict, con) -> None:
    from rich.table import Table

    from kvdiag.render.fit import show

    env = record["environment"]
    title = (f"kvdiag bench on {env['device']} (torch {env['torch']}, triton {env['triton']}); "
             f"device-to-device copy {record['copy_gbps']:.0f} GB/s")
    t = Table(title=title, title_justify="left")
    for col in ("kernel", "kv dtype", "size", "ms", "GB/s", "x copy", "vs reference", "vs token-head grid",
                "vs SDPA (gather+deq)", "vs SDPA only"):
        t.add_column(col, overflow="fold")
    for r in record["rows"]:
        if r["kernel"] == "engine":
            continue
        only = r["extra"].get("speedup_vs_sdpa_only")
        t.add_row(r["kernel"], r["kv_dtype"], r["size"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}", f"{r['vs_copy']:.2f}",
                  _speedup(r, "reference"), _speedup(r, "token_head_grid"), _speedup(r, "sdpa"),
                  f"{only:.2f}x" if only else "-")
    show(con, t)
    engine = [r for r in record["rows"] if r["kernel"] == "engine"]
    if engine:
        graphs = "on" if env.get("cuda_graphs") else "off (KVDIAG_CUDA_GRAPHS=0)"
        e = Table(title=f"engine decode tokens/s, {engine[0]['model']}, decode CUDA graphs {graphs}",
                  title_justify="left")
        for col in ("batch", "builtin tok/s", "transformers tok/s", "speedup", "builtin kernels"):
            e.add_column(col)
        for r in engine:
            e.add_row(str(r["batch"]), f"{r['builtin_tok_s']:.0f}", f"{r['transformers_tok_s']:.0f}",
                      f"{r['speedup']:.2f}x", r["builtin_kernels"])
        show(con, e)
    if record["targets"]:
        g = Table(title="targets", title_justify="left")
        for col in ("target", "kernel", "kv dtype", "size", "value", "at least", "met"):
            g.add_column(col, overflow="fold")
        for x in record["targets"]:
            g.add_row(x["target"], x["kernel"], x["kv_dtype"], x["size"], f"{x['value']:.2f}", f"{x['threshold']:.2f}",
                      "[green]yes[/green]" if x["met"] else "[bold red]no[/bold red]")
        show(con, g)
