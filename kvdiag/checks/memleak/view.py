"""The memleak check's terminal table: memory per kv dtype, cycle and stage, then the findings."""

from __future__ import annotations

COLUMNS = (("cycle", "cycle"), ("stage", "stage"), ("tensors", "tensors"), ("tensor_mib", "tensor MiB"),
           ("rss_mib", "RSS MiB"), ("cuda_allocated_mib", "CUDA alloc"), ("cuda_reserved_mib", "CUDA reserved"),
           ("driver_used_mib", "driver used"), ("nvml_process_mib", "NVML proc"), ("frozen", "frozen"))


def render(run, con) -> None:
    """One table of dtype x cycle x stage (only the columns this run measured: a CPU run has no CUDA ones), then the
    findings (holders with their chains). Numbers are never cut: a terminal too narrow for one row per snapshot with
    its dtype gets the dtype as a heading row above its snapshots, and the headers wrap instead."""
    from rich.markup import escape

    from kvdiag.render.cells import status_text
    from kvdiag.render.fit import natural_width

    cols = [(key, label) for key, label in COLUMNS
            if key in ("cycle", "stage") or any(row.get(key) is not None
                                                for c in run.cases for row in c.metrics.get("snapshots") or ())]
    for grouped, padding in ((False, 1), (True, 1), (True, 0)):  # the first that fits, else the narrowest
        t = memleak_table(run.cases, cols, grouped, padding)
        if natural_width(con, t) <= con.width:
            break
    con.print(t)
    if sizes := kv_sizes_table(run.cases):  # lines, not a table: a holder's dotted name is one long word
        title, _, rows = sizes
        con.print(title)
        for dtype, holder, a, b, ratio, verdict in rows:
            if holder == "KV cache" and a == "-":  # no KV view: the block counts give the ratio
                con.print(f"  {dtype}: KV cache not seen (no KV view), its blocks' ratio {ratio}")
            elif holder == "KV cache":
                con.print(f"  {dtype}: KV cache {a} → {b} MiB (ratio {ratio})")
            elif verdict:
                con.print(f"    {verdict}: {a} → {b} MiB (ratio {ratio}), {escape(holder)}")
            else:
                con.print("    nothing else survives shutdown at either size")
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

    from kvdiag.render.cells import status_text

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
    from kvdiag.render.cells import fmt_value

    return f"{v:.0f}" if key.endswith("_mib") and isinstance(v, (int, float)) and abs(v) >= 1000 else fmt_value(v)


def _stage(row: dict) -> str:
    return f"{row.get('cycle', '-')} {row.get('stage', '-')}"


def kv_sizes_table(cases) -> tuple[str, list[str], list[list[str]]] | None:
    """``--kv-sizes``: per kv dtype the KV cache at each size, then each holder of survivors (the KV cache's own
    left out) with its MiB at each size, their ratio and the verdict (proportional: fails as ``kv_proportional``);
    None without ``--kv-sizes``."""
    from kvdiag.render.cells import fmt_value

    runs = [(c, c.metrics["kv_sizes"]) for c in cases if c.metrics.get("kv_sizes")]
    if not runs:
        return None
    a, b = runs[0][1]["blocks"]
    rows = []
    for c, k in runs:
        rows.append([c.kv_dtype, "KV cache", *map(fmt_value, k["kv_mib"]), fmt_value(k["kv_ratio"]), ""])  # first
        for h in k["holders"] or [{"holder": "(nothing survives)", "mib": [0, 0], "ratio": None, "verdict": ""}]:
            rows.append(["", h["holder"], *map(fmt_value, h["mib"]), fmt_value(h["ratio"]), h["verdict"]])
    return (f"memleak --kv-sizes {a},{b}: what survives shutdown at each KV cache size",
            ["kv dtype", "held by", f"MiB at {a}", f"MiB at {b}", "ratio", "verdict"], rows)


def tables(run) -> list[tuple[str, list[str], list[list[str]]]]:
    """report.md and report.html: the ``--kv-sizes`` table, when the run has one."""
    sizes = kv_sizes_table(run.cases)
    return [sizes] if sizes else []
