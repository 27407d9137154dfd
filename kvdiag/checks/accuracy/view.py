"""`kvdiag accuracy`'s terminal table (and `kvdiag report RUN --format table`'s): one row per kv dtype x task or task
group (report/compact.py), then the drift of each dtype and the cases' warnings. Names are never cut: a terminal
too narrow for one row per dtype x task gets the dtype as a heading row above its tasks, and the numbers wrap
instead. With kv_needle, the worst cell of each dtype's grid (``needle_view.py``)."""

from __future__ import annotations

from kvdiag.render.cells import fmt_value, warning_lines
from kvdiag.render.fit import natural_width, show

VERDICT_STYLE = {"ok": "green", "baseline": "cyan", "unsupported": "yellow", "skipped": "yellow",
                 "inconclusive": "yellow"}
# se: lm_eval's stderr; the CI is Δ's (paired); sees: the smallest drop the documents detect with power 0.8
NUMBERS = ("score ± se", "Δ", "95% CI", "p", "sees")


def render(run, con) -> None:
    from kvdiag.checks.accuracy.needle_view import terminal_table
    from kvdiag.render.compact import compact_rows

    a = run.analysis.get("accuracy", {})
    groups = {g: v for c in run.cases for g, v in ((c.metrics.get("lm_eval") or {}).get("groups") or {}).items()}
    rows = compact_rows(a.get("rows", []), groups)
    title = (f"accuracy vs baseline '{a.get('baseline', '?')}' (max drop {a.get('max_drop')}, "
             f"alpha {a.get('alpha')}; sees: the smallest drop detected with power {a.get('power', 0.8)}; n≈: the "
             "documents that would settle an inconclusive)")
    for grouped, sees in ((False, True), (False, False), (True, True), (True, False)):  # the first that fits
        table = scores_table(rows, title, grouped=grouped, sees=sees)
        if natural_width(con, table) <= con.width:
            break
    con.print(table)
    drift = drift_table(rows, a.get("drift_by_position"))
    if drift is not None:
        show(con, drift)
    needle = terminal_table(a)
    if needle is not None:
        show(con, needle)
    if len(rows) < len(a.get("rows", [])):
        con.print(f"{len(a['rows'])} rows (every task and metric) in report.md, report.html and "
                  "`kvdiag report RUN --format csv`")
    for line in warning_lines(run.cases):
        con.print(line, markup=False)
    peaks = [c.metrics.get("peak_mib") or {} for c in run.cases]
    gpu, rss = (max((x.get(k) or 0 for x in peaks), default=0) for k in ("gpu", "rss"))
    if gpu or rss:
        con.print("peak memory of a case: " + (f"GPU {gpu:,.0f} MiB allocated, " if gpu else "")
                  + f"worker process {rss:,.0f} MiB resident")
    times = a.get("timings")
    if times:
        con.print("time in workers (summed over dtypes): " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))


def scores_table(rows: list[dict], title: str, grouped: bool, sees: bool = True):
    """grouped: the dtype on a row of its own above its tasks (the first column holds both names, never cut);
    sees: the column of the smallest drop each row's documents detect (left to report.md where it does not fit)."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD if grouped else box.HEAVY_HEAD,
              pad_edge=not grouped, show_edge=not grouped, collapse_padding=grouped)
    names = [r["kv_dtype"] for r in rows] + [_task(r) for r in rows]
    if grouped:
        t.add_column("kv dtype / task", no_wrap=True, min_width=max(map(len, names), default=4) + 1)
    else:
        t.add_column("kv dtype", no_wrap=True)
        t.add_column("task", no_wrap=True)
    numbers = NUMBERS if sees else NUMBERS[:-1]
    for col in numbers:
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("verdict", overflow="fold", min_width=10)  # "regression" whole
    last = None
    for r in rows:
        cells = [score_text(r), "-" if r.get("delta") is None else f"{r['delta']:+.3f}", ci_text(r),
                 p_text(r.get("p_value")), *([sees_text(r)] if sees else []),
                 verdict_text(r["verdict"], r.get("message") or settle_text(r))]
        if not grouped:
            t.add_row(r["kv_dtype"], _task(r), *cells)
            continue
        if r["kv_dtype"] != last:
            t.add_row(f"[bold]{r['kv_dtype']}[/]", *[""] * len(cells), end_section=False)
            last = r["kv_dtype"]
        t.add_row(f" {_task(r)}", *cells)
    return t


def _task(r: dict) -> str:
    return r["task"] if r.get("metric") in (None, "-") else f"{r['task']} {r['metric']}"


def score_text(r: dict) -> str:
    if r.get("score") is None:
        return "-"
    return fmt_value(r["score"]) + ("" if r.get("stderr") is None else f"±{r['stderr']:.2g}")


def p_text(p) -> str:
    if p is None:
        return "-"
    return f"{p:.2g}" if p >= 0.01 or p == 0 else f"{p:.0e}"  # 0.049, 5e-04


def sees_text(r: dict) -> str:
    """The smallest drop the row's documents detect with power 0.8 (power.py), as a drop: "≥0.078"."""
    mdd = r.get("mdd")
    return "-" if mdd is None else "never" if mdd != mdd or mdd == float("inf") else f"≥{mdd:.3g}"


def settle_text(r: dict) -> str | None:
    """An inconclusive row's documents that would settle it."""
    n = r.get("n_needed")
    return f"n≈{n:,}" if r.get("verdict") == "inconclusive" and n else None


def ci_text(r: dict) -> str:
    return "-" if r.get("ci_low") is None else f"[{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]"


def verdict_text(v: str, message: str | None = None) -> str:
    from rich.markup import escape

    text = f"[{VERDICT_STYLE.get(v, 'bold red')}]{v}[/]"
    return f"{text} {escape(message[:60])}" if message else text


def drift_table(rows: list[dict], by_position: list[dict] | None = None):
    """Each dtype's drift against the baseline dtype (on its first row of the analysis), and its mean KL by position
    bucket along the long continuation (the prompts' where there is none) as a sparkline, marked where it grows; with
    --drift-decoded, the same along each dtype's own decoded continuation and its first divergence."""
    from rich.table import Table

    shown = [r for r in rows if r.get("mean_kl") is not None]
    if not shown:
        return None
    spark = {r["kv_dtype"]: position_text(r) for r in by_position or ()}
    decoded = {r["kv_dtype"]: decoded_text(r) for r in by_position or () if r.get("decoded")}
    t = Table(title="token-level drift vs the baseline dtype", title_justify="left")
    cols = ("kv dtype", "KL mean / max", "top-1") + (("KL by position",) if spark else ()) + \
        (("decoded: KL mean, by position, first divergence",) if decoded else ())
    for col in cols:
        t.add_column(col, no_wrap=col == "kv dtype", justify="right" if col in ("KL mean / max", "top-1") else "left")
    for r in shown:
        t.add_row(r["kv_dtype"], f"{fmt_value(r['mean_kl'])} / {fmt_value(r['max_kl'])}",
                  fmt_value(r.get("top1_agreement")), *([spark.get(r["kv_dtype"], "-")] if spark else []),
                  *([decoded.get(r["kv_dtype"], "-")] if decoded else []))
    return t


BARS = "▁▂▃▄▅▆▇█"


def position_text(row: dict, section: str | None = None) -> str:
    """A dtype's mean KL per position bucket as a sparkline (scaled to its own largest), and ``grows Nx`` in red
    where it grows (``drift_grows``); of ``section``, else of the long continuation, else of the prompts."""
    section = section or ("long" if "long" in row["by_position"] else next(iter(row["by_position"]), None))
    kls = [b["mean_kl"] for b in row["by_position"].get(section) or () if b.get("positions")]
    top = max((k for k in kls if k == k), default=0.0)
    line = "".join("?" if k != k else BARS[min(len(BARS) - 1, int(k / top * len(BARS)))] if top > 0 else BARS[0]
                   for k in kls)
    g = (row.get("grows") or {}).get(section)
    if g:
        line += " [bold red]grows " + (f"{g['ratio']:.1f}x" if g.get("ratio") is not None else "from 0") + "[/]"
    return line


def decoded_text(row: dict) -> str:
    """The decoded drift of a dtype: its mean KL, the sparkline of its buckets, and where it first left what the
    baseline would write (``prompt P @ T``: token T, 0-based, of prompt P's continuation) or ``none``."""
    d = row["decoded"]
    first = d.get("first_divergence")
    where = "none" if first is None else f"prompt {first['prompt']} @ {first['position']}"
    return f"{fmt_value(d.get('mean_kl'))} {position_text(row, 'decoded')} {where}"
