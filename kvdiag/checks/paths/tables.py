"""The paths check in report.md and report.html: a path x kv dtype grid (the status, and the first divergence
where a path failed), then one row per case."""

from __future__ import annotations


def tables(run) -> list[tuple[str, list[str], list[list[str]]]]:
    from kvdiag.checks.paths.view import cells
    from kvdiag.checks.paths.view import path_of as _path

    dtypes = list(dict.fromkeys(c.kv_dtype for c in run.cases))
    paths = list(dict.fromkeys(_path(c) for c in run.cases))
    by = {(_path(c), c.kv_dtype): c for c in run.cases}
    grid = []
    for p in paths:
        row = [p]
        for d in dtypes:
            c = by.get((p, d))
            row.append("" if c is None else c.status + (f": {cells(c)['first']}" if c.status == "fail" else ""))
        grid.append(row)
    rows = []
    for c in run.cases:
        x = cells(c)
        floor = x["floor"] + (f" ({x['floor_by']})" if x["floor_by"] else "")
        rows.append([_path(c), c.kv_dtype, c.status, floor, x["max"], x["differ"], x["first"], x["taken"]])
    return [("paths: path x kv dtype", ["path", *dtypes], grid),
            ("paths per case", ["path", "kv dtype", "status", "floor |Δ|", "max |Δ logprob|", "prompts differ",
                                "first difference", "taken"], rows)]

