"""report.md: a job summary a person reads in CI (appended to $GITHUB_STEP_SUMMARY when set)."""

from __future__ import annotations

from collections import Counter

from kvdiag.proof.said import proof_said
from kvdiag.render.cells import fmt_value, incomplete, run_versions
from kvdiag.report.tables import tables

ICON = {"pass": "✅", "unsupported": "⏭️", "skipped": "⏭️", "fail": "❌", "error": "❌", "crashed": "💥", "timeout": "⏱️"}


def _esc(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_markdown(run) -> str:
    verdict = "passed" if run.exit_code == 0 else "FAILED"
    counts = Counter(c.status for c in run.cases)
    out = [f"# kvdiag: {verdict}", "",
           f"`{_esc(run.command)}` — started {run.started}, "
           + ", ".join(f"{n} {s}" for s, n in counts.items()), ""]
    if incomplete(run):
        out += [f"**Incomplete: {incomplete(run)}**", ""]
    out.append(_esc(", ".join(f"{k} {v}" for k, v in run_versions(run).items())))
    out += ["", "| case | status | key metrics | first finding |", "|---|---|---|---|"]
    for c in run.cases:
        first = next((f for f in c.findings if f.severity == "error"), c.findings[0] if c.findings else None)
        shown = [(k, v) for k, v in c.metrics.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
        metrics = ", ".join(f"{k}={fmt_value(v)}" for k, v in shown[:4])
        out.append(f"| {_esc(c.id)} | {ICON.get(c.status, '')} {c.status} | {_esc(metrics)} | "
                   f"{_esc(first.message) if first else ''} |")
    out += _comparison(run.analysis.get("baseline"))
    for title, header, rows in tables(run):
        out += ["", f"## {_esc(title)}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(_esc(c) for c in row) + " |" for row in rows]
    bad = [c for c in run.cases if c.status in ("fail", "error", "crashed", "timeout")]
    if bad:
        out += ["", "## Findings", ""]
        for c in bad:
            out.append(f"### {c.id} — {c.status}")
            for f in c.findings:
                out.append(f"- **{f.severity}** `{f.kind}`: {_esc(f.message)}")
                if f.evidence.get("reproduce"):  # a crash of the engine's own: the command that shows it without kvdiag
                    out += ["", "  reproduce without kvdiag:", "", "  ```", f"  {f.evidence['reproduce']}", "  ```"]
            proof = c.metrics.get("proof")
            if proof:  # kvdiag.proof: the case's standalone reproducer, and what it printed when kvdiag ran it
                out += ["", f"  reproduced without kvdiag: **{proof_said(proof)}**", "", "  ```",
                        f"  python3 {proof['script']}", "  ```", "",
                        "<details><summary>its output (tail)</summary>", "", "```", proof["output"], "```",
                        "</details>"]
            if c.log_tail:
                out += ["", "<details><summary>worker log (tail)</summary>", "", "```",
                        c.log_tail[-3000:], "```", "</details>"]
            out.append("")
    return "\n".join(out) + "\n"


def _comparison(result: dict | None) -> list[str]:
    """Rows of the comparison with a baseline that a reviewer must see: regressions, missing, improvements."""
    if not result:
        return []
    from kvdiag.report.compare import ORDER, stat_text

    shown = sorted((r for r in result["rows"] if r["verdict"] != "ok"), key=lambda r: ORDER.index(r["verdict"]))
    out = ["", f"## Against baseline `{_esc(result['old'])}`: " + ("❌ REGRESSED" if result["regressed"]
                                                                 else "✅ no regression"), ""]
    if not shown:
        return out + [f"{result['counts']['ok']} comparisons, none changed significantly.", ""]
    out += ["| case | what | old | new | Δ | test | verdict |", "|---|---|---|---|---|---|---|"]
    for r in shown:
        delta = "" if r["delta"] is None else f"{r['delta']:+.4g}"
        out.append(f"| {_esc(r['id'])} | {_esc(r['what'])} | {_esc(fmt_value(r['old']))} | "
                   f"{_esc(fmt_value(r['new']))} | {delta} | {_esc(stat_text(r))} | {r['verdict']} "
                   f"{_esc(r.get('message') or '')} |")
    return out + [""]
