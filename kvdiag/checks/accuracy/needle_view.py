"""kv_needle's grid shown (``needle.py`` computes it): the worst cell per dtype (a table in the terminal, report.md and
report.html), each dtype's grid as a table (report.md, report.html), and as a heatmap beside the baseline's
(report.html)."""

from __future__ import annotations

from kvdiag.checks.accuracy.needle import value_at
from kvdiag.render.heatmap import heatmap

WORST = ("kv dtype", "task", "grid", "worst cell", "score (n)", "baseline", "Δ")
XLABEL, YLABEL = "context length (tokens)", "needle depth (0%: the first pair)"


def depth_text(d: float) -> str:
    return f"{d:.0%}"


def cell_text(w: dict) -> str:
    return f"{w['length']} tok, depth {depth_text(w['depth'])}"


def grid_text(row: dict) -> str:
    ns = [n for r in row["n"] for n in r]
    per = f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"
    return f"{row['lengths'][0]}-{row['lengths'][-1]} tokens x {len(row['depths'])} depths, n={per}"


def worst_cells(rows: list[dict]) -> list[list[str]]:
    """A row per dtype and task: its grid, its worst cell, that cell's score and the baseline's there."""
    out = []
    for r in rows:
        w = r.get("worst")
        if w is None:
            out.append([r["kv_dtype"], f"{r['task']} {r['metric']}", grid_text(r), "-", "-", "-", "-"])
            continue
        out.append([r["kv_dtype"], f"{r['task']} {r['metric']}", grid_text(r), cell_text(w),
                    f"{w['score']:.2f} ({w['n']})", "-" if w["baseline"] is None else f"{w['baseline']:.2f}",
                    "-" if w["delta"] is None else f"{w['delta']:+.2f}"])
    return out


def title(a: dict, suffix: str = "") -> str:
    return (f"needle grid{suffix}: each kv dtype's worst cell (the largest drop from baseline '{a.get('baseline')}'s "
            "same cell, then the lowest score; n: documents a cell)")


def terminal_table(a: dict):
    """The worst cell of each dtype's grid, for the terminal; None without kv_needle."""
    from rich.table import Table

    rows = a.get("needle")
    if not rows:
        return None
    grids = "; ".join(dict.fromkeys(f"{r['task']}: {grid_text(r)}" for r in rows))
    t = Table(title=f"{title(a)}; {grids}", title_justify="left")
    for col in WORST[:2] + WORST[3:]:  # the grid is said in the title
        t.add_column(col, no_wrap=col in ("kv dtype", "worst cell"), justify="left" if col in WORST[:4] else "right")
    for cells in worst_cells(rows):
        t.add_row(*cells[:2], *cells[3:])
    return t


def tables(a: dict, suffix: str) -> list[tuple[str, tuple[str, ...], list[list[str]]]]:
    """(title, header, rows) of report.md and report.html: the worst cells, then each dtype's grid (a row per
    depth, a column per length; a dtype's cell says its change from the baseline's)."""
    rows = a.get("needle")
    if not rows:
        return []
    out = [(title(a, suffix), WORST, worst_cells(rows))]
    base = {r["task"]: r for r in rows if r["kv_dtype"] == a.get("baseline")}
    for r in rows:
        b = base.get(r["task"]) if r is not base.get(r["task"]) else None
        body = []
        for i, d in enumerate(r["depths"]):
            cells = []
            for j, n in enumerate(r["lengths"]):
                v, bv = r["score"][i][j], value_at(b, "score", n, d)
                cells.append("-" if v is None else f"{v:.2f}" + (f" ({v - bv:+.2f})" if bv is not None else ""))
            body.append([depth_text(d), *cells])
        name = f"{r['kv_dtype']}" + (f" (Δ vs '{a.get('baseline')}')" if b else "")
        out.append((f"{r['task']} {r['metric']}{suffix} per cell, {name}: needle depth x context length",
                    ("depth", *map(str, r["lengths"])), body))
    return out


def heatmaps(cases, suffix: str = "") -> list[str]:
    """report.html: per task, each dtype's grid beside the baseline's (the baseline's alone when it is the only
    dtype), its worst cell outlined."""
    base = next((c for c in cases if c.params.get("role") == "baseline"), None)
    base_grids = (base.metrics.get("needle") or {}) if base is not None else {}
    out = []
    for c in cases:
        for task, g in (c.metrics.get("needle") or {}).items():
            if c is base and any((o.metrics.get("needle") or {}).get(task) for o in cases if o is not base):
                continue  # drawn beside each dtype
            panels = [] if c is base else _panels(base, base_grids.get(task), g)
            panels.append({"name": c.kv_dtype + (" (baseline)" if c is base else ""), "values": g["score"],
                           "n": g["n"], "mark": _mark(g)})
            title = f"{task} {g['metric']} per cell{suffix}: {c.kv_dtype}" + \
                ("" if c is base else f" beside baseline {base.kv_dtype}" if base else "")
            out.append(heatmap(title, [str(n) for n in g["lengths"]], [depth_text(d) for d in g["depths"]], panels,
                               xlabel=XLABEL, ylabel=YLABEL))
    return out


def _panels(base, bg: dict | None, g: dict) -> list[dict]:
    if base is None or not bg:
        return []
    values, n = ([[value_at(bg, key, x, d) for x in g["lengths"]] for d in g["depths"]] for key in ("score", "n"))
    return [{"name": f"{base.kv_dtype} (baseline)", "values": values, "n": n, "mark": None}]


def _mark(g: dict):
    w = g.get("worst")
    if not w:
        return None
    return g["depths"].index(w["depth"]), g["lengths"].index(w["length"])
