"""A `kvdiag selftest` case in its worker: the check's own case function, then what the engine says of the case's
faults - how often each one's patched code ran in this case, which were not applicable and why - into the record
(``metrics["faults"]``), so that the self-test never counts a fault that did not fire as caught.

The engine says it through its traits' ``fault_state()`` (``kvdiag.engines.traits.EngineTraits``; vLLM's faults
record firing); an engine whose ``fault_state()`` is None records nothing (``metrics["faults"]`` absent: firing
unknown).
"""

from __future__ import annotations

TARGET = "kvdiag.checks.selftest.case:run"


def run(case, ctx):
    """Case function (runner target): the case's check's ``run`` with the fault state around it."""
    from kvdiag.checks.registry import run_case
    from kvdiag.engines.base import engine_traits

    traits = engine_traits(case.engine)
    before = traits.fault_state()
    rec = run_case(case, ctx)
    if before is not None:
        rec.metrics["faults"] = delta(before, traits.fault_state() or {}, case.params.get("faults") or [])
    return rec


def records_firing(engine: str) -> bool:
    """Whether the engine says how often its faults fired (its traits' ``fault_state()`` is not None)."""
    from kvdiag.engines.base import engine_traits

    return engine_traits(engine).fault_state() is not None


def delta(before: dict, after: dict, names: list[str]) -> dict:
    """``{"fired": {fault: times its patched code ran during the case}, "not_applicable": {fault: why}}`` for the
    case's faults."""
    was, now = before.get("fired", {}), after.get("fired", {})
    na = after.get("not_applicable", {})
    return {"fired": {n: now.get(n, 0) - was.get(n, 0) for n in names},
            "not_applicable": {n: na[n] for n in names if n in na}}
