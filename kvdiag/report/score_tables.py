"""The numeric accuracy tables of report.md and report.html, from the run's accuracy analysis: every kv dtype x task
x metric (acc_norm and every other metric, not only the primary one the terminal shows) with its score, stderr and
95% interval, the paired change against the baseline dtype with its 95% interval, p-value and test, and the verdict;
then each dtype's token-level drift, and its drift by position (mean KL / top-1 agreement per position bucket of the
prompts' and the long continuations; checks/drift_position.py). Plain strings: markdown.py and html.py each lay them
out."""

from __future__ import annotations

from kvdiag.report.cells import fmt_value

Z95 = 1.959963984540054
SCORES = ("kv dtype", "task", "metric", "n", "score", "stderr", "score 95% CI", "Δ vs baseline", "Δ 95% CI", "p",
          "test", "verdict")
DRIFT = ("kv dtype", "KL mean", "KL max", "top-1 agreement")


def tables(run) -> list[tuple[str, tuple[str, ...], list[list[str]]]]:
    """(title, header, rows) of each table: per accuracy analysis of the run (`kvdiag ci` keeps one per engine and
    model, as ``accuracy/ENGINE/MODEL``), the storage audit of a dtypes run, a selftest's matrix and what each check
    reported; none when the run has none of them."""
    out = []
    for key, a in run.analysis.items():
        if key == "selftest" and isinstance(a, dict) and a.get("faults") is not None:
            out += _selftest(a)
        if (key == "accuracy" or key.startswith("accuracy/")) and isinstance(a, dict) and a.get("rows"):
            out += _tables(a, "" if key == "accuracy" else f" ({key.partition('/')[2]})")
        if key == "dtypes" and isinstance(a, dict) and a.get("rows"):
            out.append(("What each kv dtype's cache stores (the storage audit)", STORAGE,
                        [[r["kv_dtype"], r["result"], r.get("stores") or "-", r.get("layers") or "-"]
                         for r in a["rows"]]))
            out += position_table(a.get("drift_by_position"), "")
    return out


SECTION_NAMES = {"prompts": "prompts", "long": "long continuation"}


def position_table(rows: list[dict] | None, suffix: str) -> list:
    """The drift-by-position table (one row per dtype and scored section, a column per position bucket, each cell
    ``mean KL / top-1``), as a one-element list; [] when the analysis has none."""
    from kvdiag.checks.drift_position import GROWTH

    if not rows:
        return []
    spans = sorted({(b["from"], b["to"]) for r in rows for sec in r["by_position"].values() for b in sec})
    body = []
    for r in rows:
        for section, buckets in r["by_position"].items():
            at = {(b["from"], b["to"]): b for b in buckets}
            g = (r.get("grows") or {}).get(section)
            body.append([r["kv_dtype"], SECTION_NAMES.get(section, section)]
                        + [_bucket_cell(at.get(span)) for span in spans] + [_grows_cell(g)])
    title = (f"Drift by position{suffix} vs the baseline dtype: mean KL / top-1 agreement per bucket of token "
             f"positions (drift_grows: the last bucket's KL > {GROWTH:g}x the first's and above the dtype's limit)")
    return [(title, ("kv dtype", "scored") + tuple(f"{a}-{b}" for a, b in spans) + ("KL grows",), body)]


def _bucket_cell(b: dict | None) -> str:
    if not b or not b.get("positions"):
        return "-"
    kl = b["mean_kl"]
    return f"{'0' if kl == 0 else f'{kl:.2g}'} / {b['top1_agreement']:.3f}"


def _grows_cell(g: dict | None) -> str:
    if not g:
        return "no"
    return "yes, " + (f"{g['ratio']:.1f}x" if g.get("ratio") is not None else "from 0")


STORAGE = ("kv dtype", "result", "stores", "layers (kind, dtype, size)")


def _selftest(a: dict) -> list:
    from kvdiag.report.selftest_rows import REPORTED, matrix, matrix_title, reported, verdict

    header, rows = matrix(a)
    ok, line = verdict(a)
    title = matrix_title(a.get("engine")) + (": passed, " if ok else ": FAILED, ") + line + \
        (f". {a['note']}" if a.get("note") else "")
    return [(title, header, rows), ("selftest: what each check reported", REPORTED, [list(r) for r in reported(a)])]


def _tables(a: dict, suffix: str) -> list:
    rows = a["rows"]
    title = (f"Accuracy{suffix} vs baseline '{a.get('baseline')}' (max drop {a.get('max_drop')}, alpha "
             f"{a.get('alpha')}): every task and metric")
    out = [(title, SCORES, [score_cells(r) for r in rows])]
    seen: set = set()
    drift = [r for r in rows if r.get("mean_kl") is not None and not (r["kv_dtype"] in seen or seen.add(r["kv_dtype"]))]
    if drift:
        out.append((f"Token-level drift{suffix} vs the baseline dtype", DRIFT,
                    [[r["kv_dtype"], fmt_value(r["mean_kl"]), fmt_value(r.get("max_kl")),
                      fmt_value(r.get("top1_agreement"))] for r in drift]))
    return out + position_table(a.get("drift_by_position"), suffix)


def score_cells(r: dict) -> list[str]:
    score, se = r.get("score"), r.get("stderr")
    interval = "-"
    if _num(score) and _num(se):
        lo, hi = score - Z95 * se, score + Z95 * se
        if 0 <= score <= 1:  # a proportion: the interval stays in [0, 1]
            lo, hi = max(lo, 0.0), min(hi, 1.0)
        interval = f"[{lo:.4f}, {hi:.4f}]"
    delta = r.get("delta")
    verdict = r.get("verdict", "-") + (f": {r['message']}" if r.get("message") else "")
    return [r.get("kv_dtype", "-"), r.get("task", "-"), r.get("metric", "-"), fmt_value(r.get("n")),
            fmt_value(score), fmt_value(se), interval, "-" if not _num(delta) else f"{delta:+.4f}",
            "-" if not _num(r.get("ci_low")) else f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]",
            fmt_value(r.get("p_value")), r.get("test") or "-", verdict]


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
