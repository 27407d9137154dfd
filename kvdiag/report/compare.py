"""What changed between two runs (OLD, NEW: run directories or baseline files), and did anything regress.

- Cases matched by id. A case that passed (or was unsupported) in OLD and fails, errors, crashes
  or times out in NEW is a regression; the reverse is an improvement.
- Accuracy scores, per task and metric: the paired per-document test (McNemar / paired
  bootstrap, ``checks/stats.py``) when both sides kept their samples, else a z-test on the two
  stderrs. A drop larger than ``max_drop`` that is significant at ``alpha`` (or a collapse) regresses,
  judged by the same rule as `kvdiag accuracy` (``verdicts.metric_verdict``).
- Memory (memleak): the largest growth per cycle of each measure, and the tensor MiB that survived
  shutdown. Growth beyond ``mem_tolerance_mib`` (default: the case's own growth tolerance) regresses;
  surviving tensors regress beyond min(tolerance, 1 MiB) (a census has no noise).
"""

from __future__ import annotations

import math

from kvdiag.checks.accuracy import AccuracyParams as A
from kvdiag.results import BAD_STATUSES

RETAINED_TOL_MIB = 1.0


def row(case, what: str, old, new, verdict: str, **kw) -> dict:
    """One row of a comparison (a check's compare rule returns a list of these); verdict: regression,
    improvement, ok, new or missing."""
    delta = new - old if isinstance(old, (int, float)) and isinstance(new, (int, float)) else None
    return {"id": case.id, "check": case.check, "kv_dtype": case.kv_dtype, "what": what, "old": old, "new": new,
            "delta": kw.pop("delta", delta), "verdict": verdict, **kw}


def compare(old, new, *, max_drop: float = A.max_drop, alpha: float = A.alpha,
            mem_tolerance_mib: float | None = None) -> dict:
    rows: list[dict] = []
    for cid, n in new.cases.items():
        o = old.cases.get(cid)
        if o is None:
            rows.append(row(n, "case", None, n.status, "new", message="not in OLD"))
            continue
        rows += _status(o, n)
        rows += _check_rows(o, n, {"max_drop": max_drop, "alpha": alpha, "mem_tolerance_mib": mem_tolerance_mib,
                                   "old_samples": old.samples.get(cid), "new_samples": new.samples.get(cid)})
    for cid, o in old.cases.items():
        if cid not in new.cases:
            rows.append(row(o, "case", o.status, None, "missing", message="not in NEW"))
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("regression", "improvement", "ok", "new", "missing")}
    return {"old": old.label, "new": new.label, "regressed": counts["regression"] > 0, "counts": counts,
            "settings": {"max_drop": max_drop, "alpha": alpha, "mem_tolerance_mib": mem_tolerance_mib}, "rows": rows}


def _check_rows(o, n, settings: dict) -> list[dict]:
    """The rows of the case's check (its registry entry's ``compare`` rule); scores where a check has none."""
    from kvdiag.checks.registry import get, load

    check = get(n.check)
    if check is not None and check.compare:
        return load(check.compare)(o, n, settings)
    return score_rows(o, n, settings) if "scores" in n.metrics else []


def score_rows(o, n, settings: dict) -> list[dict]:
    """accuracy's rule: every task metric's change, by the paired test where both sides kept their samples."""
    return _scores(o, n, settings.get("old_samples"), settings.get("new_samples"), settings["max_drop"],
                   settings["alpha"])


def memory_rows(o, n, settings: dict) -> list[dict]:
    """memleak's rule: growth per cycle of each measure, and the tensors that survived shutdown."""
    return _memory(o, n, settings.get("mem_tolerance_mib"))


def _status(o, n) -> list[dict]:
    if n.status == o.status:
        return []
    first = next((f.message for f in n.findings if f.severity == "error"), "")
    if n.status in BAD_STATUSES and o.status not in BAD_STATUSES:
        return [row(n, "status", o.status, n.status, "regression", message=f"newly {n.status}: {first}"[:300])]
    if o.status in BAD_STATUSES and n.status not in BAD_STATUSES:
        return [row(n, "status", o.status, n.status, "improvement", message=f"now {n.status}")]
    return [row(n, "status", o.status, n.status, "ok")]


def _scores(o, n, old_samples, new_samples, max_drop, alpha) -> list[dict]:
    from kvdiag.checks.verdicts import compare_metric, metric_verdict

    rows = []
    for task, per in (n.metrics.get("scores") or {}).items():
        for metric, sc in per.items():
            osc = (o.metrics.get("scores") or {}).get(task, {}).get(metric)
            numbers = isinstance(sc.get("score"), (int, float)) and isinstance((osc or {}).get("score"), (int, float))
            if not osc or not numbers:
                continue
            paired = None
            try:
                if old_samples and new_samples:
                    paired = compare_metric(old_samples[task][metric], new_samples[task][metric])
            except (KeyError, TypeError, ValueError):
                paired = None
            if paired is not None and paired.n > 0:
                delta, p, lo, hi, test = paired.delta, paired.p_value, paired.ci_low, paired.ci_high, paired.test
            else:
                delta, p, lo, hi = _stderr_test(osc["score"], osc.get("stderr"), sc["score"], sc.get("stderr"))
                test = "stderr"
            hib = sc.get("higher_is_better", True)
            v = metric_verdict(osc["score"], sc["score"], delta, p, hib, max_drop=max_drop, alpha=alpha)
            gain = delta if hib else -delta
            verdict = ("regression" if v in ("regression", "collapse") else
                       "improvement" if _finite(gain) and gain > max_drop and _finite(p) and p < alpha else "ok")
            rows.append(row(n, f"{task} {metric}", osc["score"], sc["score"], verdict, delta=delta, test=test,
                             p_value=p, ci_low=lo, ci_high=hi, n=paired.n if paired else sc.get("n")))
    return rows


def _stderr_test(a: float, se_a, b: float, se_b) -> tuple[float, float, float, float]:
    """Unpaired z-test of b - a from the two standard errors: (delta, p, 95% low, 95% high)."""
    delta = b - a
    se = math.sqrt(sum(s * s for s in (se_a, se_b) if _finite(s)))
    if se == 0:
        return delta, (1.0 if delta == 0 else 0.0), delta, delta
    p = math.erfc(abs(delta) / se / math.sqrt(2))
    return delta, p, delta - 1.959963984540054 * se, delta + 1.959963984540054 * se


def _memory(o, n, tol) -> list[dict]:
    rows = []
    tol = tol if tol is not None else max(_growth_tol(n), _growth_tol(o), 1.0)
    og, ng = o.metrics.get("growth_mib") or {}, n.metrics.get("growth_mib") or {}
    for measure in ng:
        if measure not in og:
            continue
        a, b = _max(og[measure]), _max(ng[measure])
        rows.append(row(n, f"growth/cycle {measure} MiB", a, b, "regression" if b - a > tol else "ok",
                         tolerance=tol))
    if "survivor_mib" in n.metrics and "survivor_mib" in o.metrics:
        a, b = _max(o.metrics["survivor_mib"]), _max(n.metrics["survivor_mib"])
        lim = min(tol, RETAINED_TOL_MIB)
        rows.append(row(n, "retained tensor MiB", a, b, "regression" if b - a > lim else "ok", tolerance=lim))
    return rows


def _growth_tol(rec) -> float:
    """The case's own tolerance for growth per cycle (memleak: the noisy measures'; older runs: threshold_mib)."""
    tols = rec.metrics.get("growth_tol_mib") or {}
    return _num(tols.get("noisy", rec.metrics.get("threshold_mib")))


def _max(values) -> float:
    vals = [v for v in values or () if _finite(v)]
    return max(vals) if vals else 0.0


def _num(v) -> float:
    return float(v) if _finite(v) else 0.0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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

    from kvdiag.report.cells import fmt_value

    t = Table(title=title or f"compare: OLD {result['old']}  →  NEW {result['new']}", title_justify="left")
    for col in ("case", "what", "old", "new", "Δ", "test (p, 95% CI)", "verdict"):
        t.add_column(col, justify="right" if col in ("old", "new", "Δ") else "left", overflow="fold")
    for r in sorted(result["rows"], key=lambda r: ORDER.index(r["verdict"])):
        t.add_row(escape(r["id"]), escape(r["what"]), fmt_value(r["old"]), fmt_value(r["new"]),
                  "-" if r["delta"] is None else f"{r['delta']:+.4g}", escape(stat_text(r)),
                  _styled(r["verdict"]) + (f" {escape(r['message'])}" if r.get("message") else ""))
    con.print(t)
    c = result["counts"]
    con.print(("[bold red]REGRESSED[/]" if result["regressed"] else "[green]no regression[/]") + ": "
              + ", ".join(f"{n} {k}" for k, n in c.items() if n))


def _styled(verdict: str) -> str:
    return f"[{STYLE[verdict]}]{verdict}[/]" if STYLE.get(verdict) else verdict


def stat_text(r: dict) -> str:
    if r.get("test"):
        ci = "" if r.get("ci_low") is None else f", [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
        return f"{r['test']} p={r['p_value']:.3g}{ci}" if _finite(r.get("p_value")) else r["test"]
    if r.get("tolerance") is not None:
        return f"tolerance {r['tolerance']:.3g} MiB"
    return ""
