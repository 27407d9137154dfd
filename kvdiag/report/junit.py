"""JUnit XML: one testsuite per check, one testcase per case. Failures carry the findings,
crashed/timed-out/errored cases carry the tail of their worker's log."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from itertools import groupby

from kvdiag.results import NOT_RUN_STATUSES


def _findings_text(case) -> str:
    lines = [f"[{f.severity}] {f.kind}: {f.message}" for f in case.findings]
    for f in case.findings:
        if f.evidence:
            lines.append(f"  {f.kind} evidence: {json.dumps(f.evidence, default=str)[:2000]}")
    return "\n".join(lines)


def _testcase(case) -> ET.Element:
    tc = ET.Element("testcase", classname=f"kvdiag.{case.check}.{case.engine}",
                    name=f"{case.id}", time=f"{case.duration_s:.3f}")
    if case.environment.get("gpu") is not None:  # the GPU that ran it (kvdiag pinned its worker there)
        props = ET.SubElement(tc, "properties")
        ET.SubElement(props, "property", name="gpu", value=str(case.environment["gpu"]))
    first = next((f for f in case.findings if f.severity == "error"), case.findings[0] if case.findings else None)
    message = first.message if first else case.status
    if case.status == "fail":
        el = ET.SubElement(tc, "failure", message=message, type=first.kind if first else "fail")
        el.text = _findings_text(case)
    elif case.status in ("error", "crashed", "timeout"):
        el = ET.SubElement(tc, "error", message=f"{case.status}: {message}", type=case.status)
        el.text = _findings_text(case) + ("\n--- worker log (tail) ---\n" + case.log_tail if case.log_tail else "")
    elif case.status in NOT_RUN_STATUSES:  # JUnit's word for a case that did not run; the message says why
        ET.SubElement(tc, "skipped", message=f"{case.status}: {message}", type=case.status)
    out = ET.SubElement(tc, "system-out")
    # a passing case's verdict and warnings first (accuracy's inconclusive: a pass that could not have seen
    # --max-drop, with the documents that would), then its metrics
    said = [f"verdict: {case.metrics['verdict']}"] if case.metrics.get("verdict") else []
    said += [f"[warning] {f.kind}: {f.message}" for f in case.findings if f.severity == "warning"]
    out.text = "\n".join(said + [json.dumps(case.metrics, default=str, indent=1)])[:20000]
    return tc


def render_junit(run) -> str:
    counts = lambda cs, st: sum(c.status in st for c in cs)  # noqa: E731
    root = ET.Element("testsuites", name="kvdiag", tests=str(len(run.cases)),
                      failures=str(counts(run.cases, ("fail",))),
                      errors=str(counts(run.cases, ("error", "crashed", "timeout"))),
                      skipped=str(counts(run.cases, NOT_RUN_STATUSES)),
                      time=f"{sum(c.duration_s for c in run.cases):.3f}")
    from kvdiag.render.cells import run_versions

    versions = run_versions(run)
    cases = sorted(run.cases, key=lambda c: c.check)
    for check, group in groupby(cases, key=lambda c: c.check):
        group = list(group)
        suite = ET.SubElement(root, "testsuite", name=f"kvdiag.{check}", tests=str(len(group)),
                              failures=str(counts(group, ("fail",))),
                              errors=str(counts(group, ("error", "crashed", "timeout"))),
                              skipped=str(counts(group, NOT_RUN_STATUSES)),
                              time=f"{sum(c.duration_s for c in group):.3f}",
                              timestamp=(run.started or "")[:19], hostname=run.environment.get("hostname", ""))
        props = ET.SubElement(suite, "properties")
        for key, value in versions.items():
            ET.SubElement(props, "property", name=key, value=value)
        for c in group:
            suite.append(_testcase(c))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
