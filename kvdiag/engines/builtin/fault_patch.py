"""A self-test fault in a reproducer's engine process (``kvdiag selftest --prove``; ``BuiltinTraits.fault_patch``
is the source that calls :func:`apply` there): the script starts the engine from the spec kvdiag recorded, which
carries no fault (``BuiltinEngine.replay_args``), so the fault is added to every start of the process instead."""

from __future__ import annotations


def apply(names) -> None:
    """Every later engine start in this process re-introduces ``names`` besides its spec's faults: the faults it parses
    (``Faults.parse``, which ``BuiltinEngine.start`` calls) get them too. Nothing imports torch here: the script sets
    the threads kvdiag's engine ran with (``OMP_NUM_THREADS``) before torch is imported."""
    from kvdiag.engines.builtin.faults import Faults

    added = Faults.expand(names)
    Faults.parse(added)  # an unknown name is said here, not at the first start
    parse = Faults.parse.__func__

    def parse_with_faults(cls, more):
        return parse(cls, [*(more or ()), *added])

    Faults.parse = classmethod(parse_with_faults)
