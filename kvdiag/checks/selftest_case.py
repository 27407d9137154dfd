"""A `kvdiag selftest` case in its worker: the check's own case function, then what the engine says of the case's
faults - how often each one's patched code ran in this case, which were not applicable and why - into the record
(``metrics["faults"]``), so that the self-test never counts a fault that did not fire as caught.

The engine says it through its ``fault_state()`` (kvdiag.engines.base.engine_traits; vLLM's faults record firing);
an engine without it records nothing (``metrics["faults"]`` absent: firing unknown).
"""

from __future__ import annotations

TARGET = "kvdiag.checks.selftest_case:run"


def run(case, ctx):
    """Case function (runner target): ``case.params["selftest_target"]`` with the fault state around it."""
    from kvdiag.case import call_target

    state = fault_state(case.engine)
    before = state() if state else None
    rec = call_target(case.params["selftest_target"])(case, ctx)
    if state is not None:
        rec.metrics["faults"] = delta(before, state(), case.params.get("faults") or [])
    return rec


def fault_state(engine: str):
    """The engine's ``fault_state`` callable, or None when it records no firing."""
    from kvdiag.engines.base import engine_traits

    f = getattr(engine_traits(engine), "fault_state", None)
    return f if callable(f) else None


def delta(before: dict, after: dict, names: list[str]) -> dict:
    """``{"fired": {fault: times its patched code ran during the case}, "not_applicable": {fault: why}}`` for the
    case's faults."""
    was, now = before.get("fired", {}), after.get("fired", {})
    na = after.get("not_applicable", {})
    return {"fired": {n: now.get(n, 0) - was.get(n, 0) for n in names},
            "not_applicable": {n: na[n] for n in names if n in na}}
