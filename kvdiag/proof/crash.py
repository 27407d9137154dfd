"""The reproducer of a failing or crashed case whose error finding carries the engine's own command (a failure inside
the engine, ``evidence.reproduce`` from kvdiag.engines.base.reproducer: a crash, or memleak's engine that cannot start
again in its process): that command in a script that says whether it dies again."""

from __future__ import annotations


def script(case) -> str | None:
    from kvdiag.proof.fill import filled

    found = next((f for f in case.findings if f.severity == "error" and f.evidence.get("reproduce")), None)
    if case.status not in ("crashed", "fail") or found is None:
        return None
    return filled("crash_script.py", {"title": case.id, "kvdiag_saw": found.message,
                                      "command": found.evidence["reproduce"]})
