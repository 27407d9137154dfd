"""Which faults `kvdiag selftest -e ENGINE` runs: the engine's own self-test catalogue (a
``kvdiag.engines.selftest.Catalogue``), which its traits give (``EngineTraits.selftest()``): the builtin engine's is
``kvdiag/engines/builtin/selftest.py``, vLLM's ``kvdiag/engines/vllm/selftest.py``, a plug-in's its own."""

from __future__ import annotations

from dataclasses import replace

from kvdiag.engines.selftest import Catalogue


def catalogue(engine: str = "builtin") -> Catalogue:
    """The self-test of ``engine``, its cases named by ``engine`` (a plug-in may be asked by its entry point's
    name or as ``package.module:factory``); UserError (exit 2, before any worker starts) for an engine that cannot
    run here (its traits' ``missing()``: vLLM not installed) or that has no self-test faults."""
    from kvdiag.engines.base import engine_traits
    from kvdiag.errors import UserError

    traits = engine_traits(engine)
    why = traits.missing()
    if why:
        raise UserError(f"kvdiag selftest -e {engine} {why}")
    found = traits.selftest()
    if found is None:
        raise UserError(f"engine '{engine}' has no self-test faults (kvdiag selftest takes an engine whose traits "
                        "give them: builtin, vllm, or a plug-in whose EngineTraits.selftest() returns a Catalogue)")
    return found if found.engine == engine else replace(found, engine=engine)  # the name it was asked by
