"""Each check's terminal table (the ``render`` of its registry entry): what the command prints and what
``kvdiag report RUN --format table`` prints again."""

from __future__ import annotations

from pathlib import Path

from kvdiag.report.accuracy_view import accuracy  # noqa: F401 - the accuracy check's render

VERDICTS = ("pass", "fail")  # a case with one: its infos are printed under the table, not in its row

COLUMNS = (("cycle", "cycle"), ("stage", "stage"), ("tensors", "tensors"), ("tensor_mib", "tensor MiB"),
           ("rss_mib", "RSS MiB"), ("cuda_allocated_mib", "CUDA alloc"), ("cuda_reserved_mib", "CUDA reserved"),
           ("driver_used_mib", "driver used"), ("nvml_process_mib", "NVML proc"), ("frozen", "frozen"))


def memleak(run, con) -> None:
    """One table of dtype x cycle x stage (only the columns this run measured: a CPU run has no CUDA ones), then the
    findings (holders with their chains). Numbers are never cut: a terminal too narrow for one row per snapshot with
    its dtype gets the dtype as a heading row above its snapshots, and the headers wrap instead."""
    from rich.markup import escape

    from kvdiag.report.cells import natural_width, status_text

    cols = [(key, label) for key, label in COLUMNS
            if key in ("cycle", "stage") or any(row.get(key) is not None
                                                for c in run.cases for row in c.metrics.get("snapshots") or ())]
    for grouped, padding in ((False, 1), (True, 1), (True, 0)):  # the first that fits, else the narrowest
        t = memleak_table(run.cases, cols, grouped, padding)
        if natural_width(con, t) <= con.width:
            break
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


def memleak_table(cases, cols: list[tuple[str, str]], grouped: bool, padding: int = 1):
    """grouped: the dtype and status on a row of their own above their snapshots (cycle and stage in the first
    column) and each number column as wide as its longest number or header word, so that only headers wrap;
    padding 0: one space between columns (what a GPU run's four device columns need at 80 columns)."""
    from rich import box
    from rich.table import Table

    from kvdiag.report.cells import status_text

    title = "memleak: memory per kv dtype, cycle and stage"
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD if grouped else box.HEAVY_HEAD,
              pad_edge=not grouped, show_edge=not grouped, collapse_padding=grouped, padding=(0, padding))
    rows = [(c, i, row) for c in cases for i, row in enumerate(c.metrics.get("snapshots") or [{}])]
    numbers = [(key, label) for key, label in cols if not (grouped and key in ("cycle", "stage"))]
    if grouped:
        names = [f"{c.kv_dtype} {c.status}" for c in cases] + [_stage(row) for _, _, row in rows]
        t.add_column("kv dtype / cycle stage", no_wrap=True, min_width=max(map(len, names), default=4) + 1)
    else:
        t.add_column("kv dtype", no_wrap=True)
        t.add_column("status")
    for key, label in numbers:
        cells = [_cell(key, row.get(key)) for _, _, row in rows]
        least = max([len(x) for x in cells] + [len(w) for w in label.split()])
        t.add_column(label, justify="left" if key == "stage" else "right", overflow="fold", min_width=least,
                     width=least if grouped else None)  # fixed: rich's shrinking of wide columns can cut others
    for c, i, row in rows:
        last = i == len(c.metrics.get("snapshots") or [{}]) - 1
        cells = [_cell(key, row.get(key)) for key, _ in numbers]
        if not grouped:
            t.add_row(c.kv_dtype if i == 0 else "", status_text(c.status) if i == 0 else "", *cells,
                      end_section=last)
            continue
        if i == 0:
            t.add_row(f"[bold]{c.kv_dtype}[/] {status_text(c.status)}", *[""] * len(cells),
                      end_section=last and not row)
        if row:  # a case without snapshots (crashed, unsupported): its heading says all
            t.add_row(f" {_stage(row)}", *cells, end_section=last)
    return t


def _cell(key: str, v) -> str:
    """MiB from 1000 up as whole MiB (16058, not fmt_value's 1.606e+04: narrower, and exact enough for a leak)."""
    from kvdiag.report.cells import fmt_value

    return f"{v:.0f}" if key.endswith("_mib") and isinstance(v, (int, float)) and abs(v) >= 1000 else fmt_value(v)


def _stage(row: dict) -> str:
    return f"{row.get('cycle', '-')} {row.get('stage', '-')}"


def mib(n) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def wake_cycle(run, con) -> None:
    """One row per case (kv dtype x sleep level): its cycles summed up (the least freed, any cycle not restored or
    not identical, the largest logprob change, NaNs), the verdict naming the cycles that failed, or the first finding
    of a case that ran no cycle (skipped, crashed)."""
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.report.cells import fmt_value, status_text

    t = Table(title="wake-cycle per kv dtype and sleep level (memory judged on the cache's device)",
              title_justify="left")
    for col in ("kv dtype", "level", "cycles", "least freed MiB (expected)", "restored", "tokens identical",
                "max |Δ logprob|", "NaN", "verdict"):
        t.add_column(col, justify="left" if col in ("kv dtype", "verdict") else "right",
                     no_wrap=col == "kv dtype", overflow="fold")
    for c in run.cases:
        m, cycles = c.metrics, c.metrics.get("cycles") or []
        level = str(m.get("level", c.params.get("level", "-"))) + (" staged" if m.get("staged") else "")
        if not cycles:
            first = next((f for f in c.findings if f.severity == "error"), c.findings[0] if c.findings else None)
            t.add_row(c.kv_dtype, level, "0", "-", "-", "-", "-", "-",
                      status_text(c.status) + (f" {escape(first.message[:120])}" if first else ""))
            continue
        freed = min((r["freed_bytes"] for r in cycles if r.get("freed_bytes") is not None), default=None)
        nan = sum((r.get("nonfinite_logprobs") or 0) + (r.get("kv_nonfinite") or 0) + (r.get("kv_bad_scales") or 0)
                  for r in cycles)
        bad = [f"c{r['cycle']}: {', '.join(r['problems'])}" for r in cycles if r.get("problems")]
        t.add_row(c.kv_dtype, level, str(len(cycles)), f"{mib(freed)} ({mib(m.get('expected_bytes'))})",
                  _all_yes(cycles, "restored"), _all_yes(cycles, "identical"),
                  fmt_value(max((r.get("max_dlogprob") or 0.0) for r in cycles)), str(nan),
                  status_text(c.status) + (f" {escape('; '.join(bad))}" if bad else ""))
    con.print(t)


def _all_yes(cycles: list[dict], key: str) -> str:
    """yes, or the cycles where not."""
    no = [str(r["cycle"]) for r in cycles if not r.get(key)]
    return "yes" if not no else f"[red]no (cycle {', '.join(no)})[/]"


def poison(run, con) -> None:
    """One row per dtype: what was poisoned, what was allocated, and what differed first."""
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.report.cells import status_text, warning_lines

    t = Table(title="poison per kv dtype (reference: the same waves with free blocks zeroed)", title_justify="left")
    for col in ("kv dtype", "value", "fresh blocks", "poisoned blocks", "identical", "NaN", "first difference",
                "status"):
        t.add_column(col, justify="right" if "blocks" in col or col == "NaN" else "left",
                     no_wrap=col == "kv dtype")
    for c in run.cases:
        m = c.metrics
        nan = "-" if "nonfinite_logprobs" not in m else str(m["nonfinite_logprobs"] + m["kv_nonfinite"] +
                                                            m["kv_bad_scales"])
        identical = "-" if "identical" not in m else ("yes" if m["identical"] else "[red]no[/]")
        t.add_row(c.kv_dtype, str(m.get("value", c.params.get("value", "-"))), str(m.get("fresh_blocks", "-")),
                  str(m.get("poisoned_blocks", "-")), identical, nan,
                  escape(_first(c)), status_text(c.status))
    con.print(t)
    for line in warning_lines([c for c in run.cases if c.status in VERDICTS], ("warning", "info")):
        con.print(escape(line))


def _first(c) -> str:
    """Where the poisoned run first differed, else the first finding (a skip's reason, a crash)."""
    f, m = c.metrics.get("first_difference"), c.metrics
    if f:
        return (f"request {f['request']} position {f['position']}: {f['got']} not {f['expected']} "
                f"({m['diverged_requests']}/{m['requests']} requests differ)")
    said = [x for x in c.findings if x.severity != "info" or c.status not in VERDICTS]  # else under the table
    first = next((x for x in said if x.severity == "error"), said[0] if said else None)
    return first.message[:90] if first else ""


STYLE = {"pass": "green", "unsupported": "yellow", "resource": "red", "crashed": "bold red", "wrong": "bold red"}


def dtypes(run, con) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.report.cells import fmt_value

    a = run.analysis.get("dtypes", {})
    t = Table(title=f"kv dtype support matrix of engine '{run.cases[0].engine if run.cases else '?'}' "
              f"(drift vs '{a.get('baseline')}')", title_justify="left")
    for col in ("kv dtype", "result", "starts", "finite", "== auto", "KL mean", "top-1", "stores",
                "K+V (+scales) B/token", "layers (kind, dtype, size)", "detail"):
        t.add_column(col, overflow="fold", max_width=70 if col == "detail" else None, no_wrap=col == "kv dtype")
    for r in a.get("rows", []):
        t.add_row(r["kv_dtype"], f"[{STYLE.get(r['result'], '')}]{r['result']}[/]", _yn(r["started"]),
                  _yn(r["finite"]), _yn(r["identical_to_auto"]), fmt_value(r["mean_kl"]),
                  fmt_value(r["top1_agreement"]), _stores(r), _token_bytes(r), escape(r.get("layers") or "-"),
                  escape(r["detail"] or ""))
    con.print(t)


def _stores(r: dict) -> str:
    from rich.markup import escape

    stores = r.get("stores")
    return "-" if stores is None else escape(stores) if not r.get("not_quantized") else f"[yellow]{escape(stores)}[/]"


def _token_bytes(r: dict) -> str:
    """K+V bytes per token over all layers, and the scales' (``+N``) where there are per-token scales."""
    kv, scales = r.get("kv_bytes_per_token"), r.get("scale_bytes_per_token")
    return "-" if kv is None else f"{kv}" + (f" +{scales}" if scales else "")


def _yn(v) -> str:
    return "-" if v is None else ("yes" if v else "no")


SELFTEST_STYLE = {"caught": "green", "pass": "green", "missed": "bold red", "findings": "bold red",
                  "warnings": "yellow", "did not fire": "bold red", "n/a": "dim", "not applicable": "dim", "-": "dim"}


def selftest(run, con) -> None:
    """The matrix (intended checks marked *, whether each fault fired), then the finding behind each caught, missed
    or not fired cell, and why each fault that cannot apply here is n/a."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.report.selftest_rows import matrix, matrix_title, reported, verdict

    a = run.analysis.get("selftest")
    if not a:
        return
    header, rows = matrix(a)
    t = Table(title=matrix_title(a.get("engine")), title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for col in header:
        t.add_column(col, no_wrap=True)  # names whole at 80 columns: the marks are short
    for i, row in enumerate(rows):
        marks = [_mark(m.rstrip("*"), m.endswith("*")) for m in row[3:-1]]
        t.add_row(row[0], row[1], row[2] if i else "-", *marks, _mark(row[-1]), end_section=i == 0)
    con.print(t)
    f = Table(title="what each check reported", title_justify="left")
    for col in ("fault", "check", "result", "finding"):
        f.add_column(col, overflow="fold", max_width=110 if col == "finding" else None)
    for fault, check, mark, finding in reported(a):
        f.add_row(fault, check, _mark(mark), escape(finding[:500]))
    con.print(f)
    if a.get("note"):
        con.print(f"[dim]{escape(a['note'])}[/]")
    ok, line = verdict(a)
    con.print(("[green]selftest passed[/]: " if ok else "[bold red]selftest failed[/]: ") + escape(line))


def _mark(mark: str, intended: bool = False) -> str:
    text = mark + ("*" if intended else "")
    style = SELFTEST_STYLE.get(mark, "")
    return f"[{style}]{text}[/]" if style else text


def ci(run, con) -> None:
    """The cases, then the comparison with the baseline when there is one."""
    from kvdiag.report.cells import cases_table

    con.print(cases_table(run.cases, "kvdiag ci"))
    if run.analysis.get("baseline"):
        from kvdiag.report.compare import render_table

        render_table(run.analysis["baseline"], con, title=f"against baseline {run.analysis['baseline']['old']}")
    for name in ("report.md", "report.html", "junit.xml"):
        con.print(f"wrote {Path(run.run_dir) / name}")
