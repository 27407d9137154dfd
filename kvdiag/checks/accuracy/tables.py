"""The numeric accuracy tables of report.md and report.html, from the run's accuracy analysis: every kv dtype x task
x metric (acc_norm and every other metric, not only the primary one the terminal shows) with its score, stderr and
95% interval, the paired change against the baseline dtype with its 95% interval, p-value and test, and the verdict;
then each dtype's token-level drift, and its drift by position (mean KL / top-1 agreement per position bucket of the
prompts' and the long continuations; checks/sweep/drift_position.py). Plain strings: markdown.py and html.py each lay
them out."""

from __future__ import annotations

from kvdiag.checks.accuracy.needle_view import tables as needle_tables
from kvdiag.checks.sweep.drift import TIE_NATS
from kvdiag.checks.sweep.drift_position import position_table
from kvdiag.checks.sweep.stats import Z95
from kvdiag.render.cells import fmt_value

SCORES = ("kv dtype", "task", "metric", "n", "score", "stderr", "score 95% CI", "Δ vs baseline", "Δ 95% CI", "p",
          "test", "smallest drop seen (power 0.8)", "n to see max drop", "verdict")
DRIFT = ("kv dtype", "KL mean", "KL max", "top-1 agreement")
DECODED = ("kv dtype", "tokens", "positions", "KL mean", "KL max", "top-1 agreement", "first divergence",
           "prompts diverged")


def tables(run) -> list[tuple[str, tuple[str, ...], list[list[str]]]]:
    """(title, header, rows) of each table of every accuracy analysis of the run (`kvdiag ci` keeps one per engine
    and model, as ``accuracy/ENGINE/MODEL``)."""
    out = []
    for key, a in run.analysis.items():
        if (key == "accuracy" or key.startswith("accuracy/")) and isinstance(a, dict) and a.get("rows"):
            out += _tables(a, "" if key == "accuracy" else f" ({key.partition('/')[2]})")
    return out


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
    return out + decoded_table(a.get("drift_by_position"), suffix) + \
        position_table(a.get("drift_by_position"), suffix) + needle_tables(a, suffix)


def decoded_table(rows: list[dict] | None, suffix: str) -> list:
    """The decoded drift (--drift-decoded; checks/accuracy/drift_decoded.py) of each dtype, as a one-element list; []
    when the run has none."""
    rows = [r for r in rows or () if r.get("decoded")]
    if not rows:
        return []
    body = []
    for r in rows:
        d, first = r["decoded"], r["decoded"].get("first_divergence")
        body.append([r["kv_dtype"], fmt_value(d.get("tokens")), fmt_value(d.get("positions")),
                     fmt_value(d.get("mean_kl")), fmt_value(d.get("max_kl")), fmt_value(d.get("top1_agreement")),
                     "none" if first is None else f"prompt {first['prompt']}, token {first['position']}",
                     fmt_value(d.get("diverged"))])
    return [(f"Decoded drift{suffix}: each dtype's own greedy continuation, scored teacher-forced by it and by the "
             f"baseline dtype (first divergence: the first token the baseline ranks more than {TIE_NATS:g} nats "
             "below its top)", DECODED, body)]


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
            fmt_value(r.get("p_value")), r.get("test") or "-", fmt_value(r.get("mdd")), fmt_value(r.get("n_needed")),
            verdict]


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
