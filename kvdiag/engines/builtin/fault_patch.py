"""A self-test fault in a reproducer's engine process (``kvdiag selftest --prove``; ``BuiltinTraits.fault_patch``
is the source that calls :func:`apply` there): the script starts the engine from the spec kvdiag recorded, which
carries no fault (``BuiltinEngine.replay_args``), so the fault is added to every start of the process instead."""

from __future__ import annotations


def apply(names) -> None:
    """Every later start of a ``BuiltinEngine`` in this process re-introduces ``names`` besides its spec's faults."""
    from dataclasses import replace

    from kvdiag.engines.builtin.engine import BuiltinEngine
    from kvdiag.engines.builtin.faults import Faults

    added = tuple(Faults.expand(names))
    Faults.parse(added)  # an unknown name is said here, not at the first start
    start = BuiltinEngine.start

    def start_with_faults(self, spec):
        return start(self, replace(spec, faults=tuple(spec.faults) + added))

    BuiltinEngine.start = start_with_faults
