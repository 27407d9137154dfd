"""The accuracy table a terminal can hold for a real suite: one row per kv dtype x task, or x task group (mmlu's
57 subtasks are one row), with the task's primary metric (the first of its metric list, as lm_eval lists them;
another metric of a task outside a group where its verdict is not ok), and the drift of a dtype on its first row
only. Every metric of every task stays in run.json, report.md/html and `kvdiag report RUN --format csv`."""

from __future__ import annotations

import math

DRIFT_KEYS = ("mean_kl", "max_kl", "top1_agreement")
# verdicts of a task's other metrics that the table leaves to report.md
SHOWN_QUIET = ("baseline", "skipped", "unsupported", "ok", "inconclusive")
# a group's verdict: its worst task's
WORST = ("baseline", "skipped", "unsupported", "ok", "inconclusive", "drift", "regression", "collapse")


def compact_rows(rows: list[dict], groups: dict | None = None) -> list[dict]:
    """The analysis rows of `kvdiag accuracy`, reduced as the module says; rows of cases that did not run pass."""
    leaf_group = {leaf: g for g, leaves in (groups or {}).items() for leaf in leaves}
    primary: dict = {}
    order: list = []
    members: dict = {}
    for r in rows:
        if r.get("task", "-") == "-":
            order.append(r)
            continue
        if primary.setdefault(r["task"], r["metric"]) != r["metric"]:
            if r.get("verdict") not in SHOWN_QUIET and r["task"] not in leaf_group:  # another metric that failed
                order.append(r)
            continue
        key = (r["kv_dtype"], leaf_group.get(r["task"], r["task"]))
        if key not in members:
            members[key] = []
            order.append(key)
        members[key].append(r)
    out, shown = [], set()
    for item in order:
        row = dict(item) if isinstance(item, dict) else merge(item[1], members[item])
        if row["kv_dtype"] in shown:
            row.update(dict.fromkeys(DRIFT_KEYS), drift_shown=True)
        shown.add(row["kv_dtype"])
        out.append(row)
    return out


def merge(name: str, rows: list[dict]) -> dict:
    """One row for a group's tasks: scores, baseline and change weighted by documents (lm_eval's default for a
    group), the worst verdict and how many tasks have it."""
    if len(rows) == 1:
        return dict(rows[0])
    n = [r.get("n") or 0 for r in rows]
    total = sum(n) or 1
    verdict = max((r["verdict"] for r in rows), key=lambda v: WORST.index(v) if v in WORST else len(WORST))
    bad = sum(r["verdict"] == verdict for r in rows)
    out = {**rows[0], "task": f"{name} ({len(rows)} tasks)", "n": sum(n), "verdict": verdict,
           "ci_low": None, "ci_high": None, "p_value": None, "discordant": None, "mdd": None, "n_needed": None,
           "message": f"{bad} of {len(rows)} tasks" if verdict not in ("ok", "baseline") else None}
    for key in ("score", "baseline", "delta"):
        values = [r.get(key) for r in rows]
        out[key] = (sum(w * v for w, v in zip(n, values)) / total
                    if all(isinstance(v, (int, float)) for v in values) else None)
    errs = [r.get("stderr") for r in rows]
    out["stderr"] = (math.sqrt(sum((w / total * e) ** 2 for w, e in zip(n, errs)))
                     if all(isinstance(e, (int, float)) for e in errs) else None)
    return out
