"""What changed between two runs (OLD, NEW: run directories or baseline files), and did anything regress.

- Cases matched by id. A case that passed (or was unsupported) in OLD and fails, errors, crashes
  or times out in NEW is a regression; the reverse is an improvement.
- Then each case's own check's rule (its registry entry's ``compare``: accuracy's scores, memleak's memory; a
  check's folder, ``compare.py``).
"""

from __future__ import annotations

from kvdiag.checks.accuracy import AccuracyParams as A
from kvdiag.checks.compare_rows import finite, row
from kvdiag.results import BAD_STATUSES


def compare(old, new, *, max_drop: float = A.max_drop, alpha: float = A.alpha,
            mem_tolerance_mib: float | None = None) -> dict:
    rows: list[dict] = []
    for cid, n in new.cases.items():
        o = old.cases.get(cid)
        if o is None:
            rows.append(row(n, "case", None, n.status, "new", message="not in OLD"))
            continue
        rows += _status(o, n) + _proof(o, n)
        rows += _check_rows(o, n, {"max_drop": max_drop, "alpha": alpha, "mem_tolerance_mib": mem_tolerance_mib,
                                   "old_samples": old.samples.get(cid), "new_samples": new.samples.get(cid)})
    for cid, o in old.cases.items():
        if cid not in new.cases:
            rows.append(row(o, "case", o.status, None, "missing", message="not in NEW"))
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("regression", "improvement", "ok", "new", "missing")}
    return {"old": old.label, "new": new.label, "regressed": counts["regression"] > 0, "counts": counts,
            "settings": {"max_drop": max_drop, "alpha": alpha, "mem_tolerance_mib": mem_tolerance_mib}, "rows": rows}


def _check_rows(o, n, settings: dict) -> list[dict]:
    """The rows of the case's check (its check's ``compare`` rule); scores where a check has none."""
    from kvdiag.checks.registry import get

    check = get(n.check)
    if check is not None and check.compare:
        return check.compare(o, n, settings)
    if "scores" in n.metrics:  # a run of an older kvdiag, or of a plug-in check, that kept accuracy scores
        return get("accuracy").compare(o, n, settings)
    return []


def _proof(o, n) -> list[dict]:
    """Whether each side's failure reproduced without kvdiag (``kvdiag.proof``), where either side says."""
    from kvdiag.proof.said import proof_said

    a, b = (getattr(x, "metrics", {}).get("proof") for x in (o, n))
    if not (a or b):
        return []
    return [row(n, "reproduced without kvdiag", proof_said(a) if a else "-", proof_said(b) if b else "-", "ok",
                message=f"python3 {(b or a)['script']}")]


def _status(o, n) -> list[dict]:
    if n.status == o.status:
        return []
    first = next((f.message for f in n.findings if f.severity == "error"), "")
    if n.status in BAD_STATUSES and o.status not in BAD_STATUSES:
        return [row(n, "status", o.status, n.status, "regression", message=f"newly {n.status}: {first}"[:300])]
    if o.status in BAD_STATUSES and n.status not in BAD_STATUSES:
        return [row(n, "status", o.status, n.status, "improvement", message=f"now {n.status}")]
    return [row(n, "status", o.status, n.status, "ok")]


COLUMNS = ("id", "check", "kv_dtype", "what", "old", "new", "delta", "verdict", "test", "p_value", "ci_low", "ci_high",
           "n", "tolerance", "message")


def compare_frame(result: dict):
    """The rows of a comparison as a pandas DataFrame, one per case x what was compared (``kvdiag compare
    --format csv`` writes it)."""
    import pandas as pd

    return pd.DataFrame([{k: r.get(k) for k in COLUMNS} for r in result["rows"]], columns=list(COLUMNS))


STYLE = {"regression": "bold red", "improvement": "green", "ok": "", "new": "cyan", "missing": "yellow"}
ORDER = ("regression", "missing", "improvement", "new", "ok")


def render_table(result: dict, con, title: str | None = None) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.render.cells import fmt_value
    from kvdiag.render.fit import show

    t = Table(title=title or f"compare: OLD {result['old']}  →  NEW {result['new']}", title_justify="left")
    for col in ("case", "what", "old", "new", "Δ", "test (p, 95% CI)", "verdict"):
        t.add_column(col, justify="right" if col in ("old", "new", "Δ") else "left", overflow="fold")
    for r in sorted(result["rows"], key=lambda r: ORDER.index(r["verdict"])):
        t.add_row(escape(r["id"]), escape(r["what"]), fmt_value(r["old"]), fmt_value(r["new"]),
                  "-" if r["delta"] is None else f"{r['delta']:+.4g}", escape(stat_text(r)),
                  _styled(r["verdict"]) + (f" {escape(r['message'])}" if r.get("message") else ""))
    show(con, t)
    c = result["counts"]
    con.print(("[bold red]REGRESSED[/]" if result["regressed"] else "[green]no regression[/]") + ": "
              + ", ".join(f"{n} {k}" for k, n in c.items() if n))


def _styled(verdict: str) -> str:
    return f"[{STYLE[verdict]}]{verdict}[/]" if STYLE.get(verdict) else verdict


def stat_text(r: dict) -> str:
    if r.get("test"):
        ci = "" if r.get("ci_low") is None else f", [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
        return f"{r['test']} p={r['p_value']:.3g}{ci}" if finite(r.get("p_value")) else r["test"]
    if r.get("tolerance") is not None:  # in the row's unit: MiB (memleak), prompts, or a logprob (paths)
        return f"tolerance {r['tolerance']:.3g}" + (f" {r['unit']}" if r.get("unit") else "")
    return ""
