"""report.html: one self-contained page (inline CSS and SVG, no scripts, no network)."""

from __future__ import annotations

from html import escape

from kvdiag.proof.said import proof_said
from kvdiag.render.cells import fmt_value, incomplete, run_versions
from kvdiag.report.tables import tables

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px} h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0} td,th{border:1px solid #ddd;padding:4px 8px;text-align:left}
th{background:#f4f4f4} .pass{color:#1a7f37} .fail,.error,.crashed,.timeout{color:#cf222e;font-weight:bold}
.skipped,.unsupported{color:#9a6700}
.plots{display:flex;flex-wrap:wrap;gap:16px} .plot{border:1px solid #eee;background:#fff}
pre{background:#f6f8fa;padding:8px;overflow:auto;max-height:300px;font-size:12px} .muted{color:#666}
"""


def render_html(run) -> str:
    from kvdiag.report.plots import plots_for

    verdict = "passed" if run.exit_code == 0 else "FAILED"
    versions = ", ".join(f"{k} {v}" for k, v in run_versions(run).items())
    out = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>kvdiag: {verdict}</title>",
           f"<style>{CSS}</style></head><body>",
           f"<h1>kvdiag: <span class='{'pass' if run.exit_code == 0 else 'fail'}'>{verdict}</span></h1>",
           *([f"<p class='fail'>Incomplete: {escape(incomplete(run))}</p>"] if incomplete(run) else []),
           f"<p><code>{escape(run.command)}</code><br><span class='muted'>started {escape(str(run.started))}"
           f" · finished {escape(str(run.finished))} · " + escape(versions)
           + "</span></p>"]
    out += _comparison(run.analysis.get("baseline"))
    for title, header, rows in tables(run):
        out.append(f"<h2>{escape(title)}</h2><table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>")
        out += ["<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        out.append("</table>")
    figures = plots_for(run)
    if figures:
        out.append("<h2>Plots</h2><div class='plots'>" + "".join(figures) + "</div>")
    out.append("<h2>Cases</h2><table><tr><th>case</th><th>status</th><th>metrics</th><th>findings</th>"
               "<th>time</th></tr>")
    for c in run.cases:
        shown = [(k, v) for k, v in c.metrics.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
        metrics = "<br>".join(f"{escape(k)}={escape(fmt_value(v))}" for k, v in shown[:8])
        findings = "<br>".join(f"<b>{escape(f.kind)}</b>: {escape(f.message)}" for f in c.findings[:6])
        if c.metrics.get("proof"):  # kvdiag.proof: said whatever the findings before it
            proof = c.metrics["proof"]
            findings += (f"<br><b>reproduced without kvdiag</b>: {escape(proof_said(proof))}: "
                         f"<code>python3 {escape(proof['script'])}</code>")
        out.append(f"<tr><td>{escape(c.id)}</td><td class='{c.status}'>{c.status}</td>"
                   f"<td>{metrics}</td><td>{findings}</td><td>{c.duration_s:.1f}s</td></tr>")
    out.append("</table>")
    for c in run.cases:
        if c.log_tail and c.status in ("crashed", "timeout", "error"):
            out.append(f"<h2>{escape(c.id)}: worker log (tail)</h2><pre>{escape(c.log_tail[-4000:])}</pre>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _comparison(result: dict | None) -> list[str]:
    """The comparison with a baseline (`kvdiag ci --baseline`): what regressed first."""
    if not result:
        return []
    from kvdiag.report.compare import ORDER, stat_text

    head = "REGRESSED" if result["regressed"] else "no regression"
    out = [f"<h2>Against baseline <code>{escape(result['old'])}</code>: "
           f"<span class='{'fail' if result['regressed'] else 'pass'}'>{head}</span></h2>",
           "<table><tr><th>case</th><th>what</th><th>old</th><th>new</th><th>Δ</th><th>test</th><th>verdict</th></tr>"]
    for r in sorted(result["rows"], key=lambda r: ORDER.index(r["verdict"])):
        cls = {"regression": "fail", "improvement": "pass"}.get(r["verdict"], "")
        delta = "" if r["delta"] is None else f"{r['delta']:+.4g}"
        out.append(f"<tr><td>{escape(r['id'])}</td><td>{escape(r['what'])}</td><td>{escape(fmt_value(r['old']))}</td>"
                   f"<td>{escape(fmt_value(r['new']))}</td><td>{delta}</td><td>{escape(stat_text(r))}</td>"
                   f"<td class='{cls}'>{escape(r['verdict'])} {escape(r.get('message') or '')}</td></tr>")
    out.append("</table>")
    return out
