"""kv_needle's grid in the parent: each dtype's score per cell (context length x needle depth), counted from its
per-document results and the cell each document was tagged with in the worker (``needle_cells``), and its worst
cell: the largest drop from the baseline's same cell, then the lowest score (the baseline's own: its lowest).
Each case keeps its grids (``metrics.needle``: the plots draw them); the analysis keeps a row per dtype and task."""

from __future__ import annotations

import json
import math
from pathlib import Path


def grid(cells: dict, values: dict) -> dict:
    """``{"lengths", "depths", "score", "n"}`` of one task: ``cells`` {doc_id: [length, depth]}, ``values`` {doc_id:
    value}; ``score[i][j]`` is the mean of depth i and length j (None where no document has a finite value)."""
    lengths = sorted({c[0] for c in cells.values()})
    depths = sorted({c[1] for c in cells.values()})
    total = {(n, d): [0.0, 0] for n in lengths for d in depths}
    for doc, (n, d) in cells.items():
        v = values.get(doc)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            total[(n, d)][0] += v
            total[(n, d)][1] += 1
    return {"lengths": lengths, "depths": depths,
            "score": [[total[(n, d)][0] / total[(n, d)][1] if total[(n, d)][1] else None for n in lengths]
                      for d in depths],
            "n": [[total[(n, d)][1] for n in lengths] for d in depths]}


def worst(g: dict, base: dict | None) -> dict | None:
    """The cell of ``g`` that dropped most from ``base``'s same cell (None: no baseline), then the lowest, then the
    longest and deepest: ``{"length", "depth", "score", "n", "baseline", "delta"}``; None without a scored cell."""
    found = []
    for i, d in enumerate(g["depths"]):
        for j, n in enumerate(g["lengths"]):
            v = g["score"][i][j]
            if v is None:
                continue
            b = value_at(base, "score", n, d)
            delta = v - b if b is not None else None
            found.append(((delta if delta is not None else 0.0, v, -n, -d),
                          {"length": n, "depth": d, "score": v, "n": g["n"][i][j], "baseline": b, "delta": delta}))
    return min(found, key=lambda x: x[0])[1] if found else None


def value_at(g: dict | None, key: str, length: int, depth: float):
    """``g[key]`` (``score``, ``n``) of the cell (length, depth); None where ``g`` has no such cell."""
    if not g or length not in g["lengths"] or depth not in g["depths"]:
        return None
    return g[key][g["depths"].index(depth)][g["lengths"].index(length)]


def analyze(run, cases, base) -> list[dict]:
    """Each case's grids into ``metrics.needle`` ({task: grid with ``metric`` and ``worst``}), the baseline's first;
    the rows of the analysis (``run.analysis["accuracy"]["needle"]``)."""
    base_grids = case_grids(run, base) if base is not None else {}
    rows = []
    for rec in ([base] if base is not None else []) + [c for c in cases if c is not base]:
        grids = base_grids if rec is base else case_grids(run, rec)
        if not grids:
            continue
        for task, g in grids.items():
            g["worst"] = worst(g, None if rec is base else base_grids.get(task))
            rows.append({"kv_dtype": rec.kv_dtype, "task": task, **g})
        rec.metrics["needle"] = grids
    return rows


def case_grids(run, rec) -> dict:
    """{task: grid} of a case that scored tagged documents (its samples artifact and ``needle_cells``)."""
    cells = rec.metrics.get("needle_cells") or {}
    name = (rec.metrics.get("artifacts") or {}).get("samples")
    path = Path(run.run_dir) / "artifacts" / name if name else None
    if not cells or path is None or not path.exists():
        return {}
    samples = json.loads(path.read_text())
    out = {}
    for task, tagged in cells.items():
        per = samples.get(task) or {}
        metric = "acc" if "acc" in per else next(iter(per), None)
        if metric is not None:
            out[task] = {"metric": metric, **grid(tagged, per[metric])}
    return out
