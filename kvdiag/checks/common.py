"""What every check does inside its worker: start the engine a case names, and the fixed prompts."""

from __future__ import annotations

import os

from kvdiag.engines.base import Engine, EngineSpec, create_engine

TEST_DISABLE_ENV = "KVDIAG_TEST_DISABLE"

SPEC_FIELDS = ("max_model_len", "block_size", "num_blocks", "kv_cache_memory", "max_num_seqs", "device", "dtype",
               "seed", "enable_sleep", "prefix_caching")


def engine_spec(case, **overrides) -> EngineSpec:
    """The EngineSpec for a case: model and kv dtype from the case, the rest from case.params."""
    p = case.params
    kw = {k: p[k] for k in SPEC_FIELDS if p.get(k) is not None}
    kw.update(overrides)
    return EngineSpec(model=case.model, kv_cache_dtype=case.kv_dtype, faults=tuple(p.get("faults") or ()),
                      engine_args=dict(p.get("engine_args") or {}), **kw)


def start_engine(case, weights_from: Engine | None = None, **overrides) -> Engine:
    """Create and start the case's engine; ``weights_from``: a started engine of the same kind whose loaded
    weights it uses instead of reading them again (``share_weights``, builtin engine)."""
    engine = create_engine(case.engine)
    if weights_from is not None:
        engine.share_weights(weights_from)
    engine.start(engine_spec(case, **overrides))
    return engine


def device_info() -> dict:
    """What the worker runs on (recorded in each case's environment)."""
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
    return info


def detector_disabled(name: str) -> bool:
    """For kvdiag's own tests only: ``KVDIAG_TEST_DISABLE=memleak.holders`` (comma-separated names) switches
    that detector off, so a test can show that `kvdiag selftest` reports the fault it exists for as missed.
    Detectors: ``memleak.holders`` (the referrer census that names what holds a surviving tensor)."""
    return name in os.environ.get(TEST_DISABLE_ENV, "").replace(" ", "").split(",")
