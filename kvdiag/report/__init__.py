"""Renderers of a run: terminal table, report.md, report.html (with plots), junit.xml, run.json."""

from __future__ import annotations

import os
from pathlib import Path

FORMATS = {"md": "report.md", "html": "report.html", "junit": "junit.xml", "json": "run.json"}


def render(run, fmt: str) -> str:
    if fmt == "md":
        from kvdiag.report.markdown import render_markdown

        return render_markdown(run)
    if fmt == "html":
        from kvdiag.report.html import render_html

        return render_html(run)
    if fmt == "junit":
        from kvdiag.report.junit import render_junit

        return render_junit(run)
    if fmt == "json":
        import json

        return json.dumps(run.to_json(), indent=2) + "\n"
    raise ValueError(f"unknown report format {fmt!r}; valid: {', '.join(FORMATS)}")


def write_reports(run, run_dir: Path, formats=("md", "html", "junit", "json")) -> list[Path]:
    """Write the chosen reports into the run directory; append report.md to $GITHUB_STEP_SUMMARY."""
    paths = []
    for fmt in formats:
        path = Path(run_dir) / FORMATS[fmt]
        text = render(run, fmt)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        paths.append(path)
        if fmt == "md" and os.environ.get("GITHUB_STEP_SUMMARY"):
            with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:
                f.write(text)
    return paths
