"""Which faults `kvdiag selftest -e ENGINE` runs: each engine's self-test catalogue (a ``selftest_plan.Catalogue``)."""

from __future__ import annotations

from kvdiag.checks.selftest_plan import BUILTIN, Catalogue


def catalogue(engine: str = "builtin") -> Catalogue:
    """The self-test of ``engine``: the builtin engine's (``selftest_plan.BUILTIN``), vLLM's
    (``selftest_vllm.py``), or a plug-in engine's factory's ``SELFTEST`` (a :class:`Catalogue`); UserError for an
    engine without one."""
    from kvdiag.errors import UserError

    if engine == "builtin":
        return BUILTIN
    if engine == "vllm":
        from kvdiag.checks.selftest_vllm import CATALOGUE

        return CATALOGUE
    from kvdiag.engines.base import engine_traits

    found = getattr(engine_traits(engine), "SELFTEST", None)
    if not isinstance(found, Catalogue):
        raise UserError(f"engine '{engine}' has no self-test faults (kvdiag selftest takes builtin, vllm, or a plug-in "
                        "engine whose factory has SELFTEST)")
    return found
