"""What every check does inside its worker: start the engine a case names, and the fixed prompts."""

from __future__ import annotations

import os

from kvdiag.case import LOG_TAIL_CHARS
from kvdiag.engines.base import Engine, EngineSpec, create_engine
from kvdiag.errors import EngineUnsupported
from kvdiag.models import config_dtype

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


def replay_of(engine, prompts) -> dict:
    """How the engine was started and the prompts' token ids, where the engine can say (``protocol.Replayable``):
    what a failing case's reproducer runs again (``kvdiag.proof``); {} where it cannot."""
    from kvdiag.engines.protocol import Replayable

    args = engine.replay_args() if isinstance(engine, Replayable) else None
    return {"replay": args, "prompts": [list(map(int, q)) for q in prompts]} if args else {}


def start_engine(case, weights_from: Engine | None = None, **overrides) -> Engine:
    """Create and start the case's engine; ``weights_from``: a started engine of the same kind whose loaded
    weights it uses instead of reading them again (``share_weights``, builtin engine)."""
    engine = create_engine(case.engine)
    if weights_from is not None:
        engine.share_weights(weights_from)
    engine.start(engine_spec(case, **overrides))
    return engine


def spec_starter(spec: EngineSpec):
    """A ``start`` for :func:`start_or_record` that starts the case's engine with ``spec`` (a check's own)."""
    def start(case) -> Engine:
        engine = create_engine(case.engine)
        engine.start(spec)
        return engine
    return start


REFUSALS = (EngineUnsupported, NotImplementedError, ValueError)  # how engines say "not here" (pydantic's
# ValidationError, vLLM's config errors, is a ValueError)


def refused(exc: BaseException) -> str | None:
    """The engine's words when ``exc`` is it refusing a configuration at start (EngineUnsupported; vLLM's config
    validation and attention-backend selection raise ValueError/NotImplementedError), else None. Out of device
    memory is never a refusal (``errors.resource_failure``)."""
    from kvdiag.errors import first_line, resource_failure

    if resource_failure(exc) or not isinstance(exc, REFUSALS):
        return None
    return first_line(exc)


class WorkloadFailed(Exception):
    """The engine raised while it served a check's workload (its ``__cause__``): the engine crashed, not kvdiag
    (``engine_failed`` words it, in the stage the check names). ``call``: the call that died, where the check says
    (a generate call's prompts as token ids, ``max_tokens``, ``logprobs``): what a crash's reproducer makes again."""

    def __init__(self, what: str = "workload", call: dict | None = None):
        super().__init__(what)
        self.call = call


def engine_failed(case, exc: BaseException, stage: str, **metrics):
    """The record of a case whose engine raised in ``stage`` ("engine start", "drift probe", "lm_eval"): status
    ``crashed`` with a ``crashed`` finding that names the stage, or, when the device ran out of memory, ``error``
    with a ``resource`` finding (an error of the run, not of the engine)."""
    import traceback

    from kvdiag.errors import first_line, resource_failure

    resource = resource_failure(exc)
    rec = case.result("error" if resource else "crashed", metrics=metrics,
                      log_tail=traceback.format_exc()[-LOG_TAIL_CHARS:])
    rec.add("error", "resource" if resource else "crashed",
            resource or f"{stage}: {type(exc).__name__}: {first_line(exc)}"[:500], stage=stage,
            **({} if resource else failure_evidence(case, exc, stage)))
    return rec


def failure_evidence(case, exc: BaseException, stage: str, sleep_level: int | None = None) -> dict:
    """What a finding on an engine's failure carries besides its words: ``where`` it was raised (the innermost
    frame, e.g. in vLLM's own code) and a command that ``reproduce``s it without kvdiag (the engine's, if any)."""
    from kvdiag.engines.base import reproducer
    from kvdiag.errors import raised_in

    out = {"where": raised_in(exc), "reproduce": reproducer(case.engine, stage, sleep_level)}
    return {k: v for k, v in out.items() if v}


def start_or_record(case, start=None, alone: bool = False):
    """(engine, None) when the case's engine started; else (None, record): ``unsupported`` in the engine's words
    when it refused the case's configuration, ``crashed`` when it raised anything else, ``error``/``resource``
    when the device ran out of memory. Every check that starts an engine per case words these the same way."""
    try:
        return (start or start_engine)(case), None
    except Exception as e:  # noqa: BLE001 - the engine's failure is the case's record
        return None, start_failed(case, e, alone)


def start_failed(case, exc: BaseException, alone: bool = False):
    """The record of a case whose engine did not start (``start_or_record``'s words). ``alone``: a check that runs
    one dtype with no ``auto`` case beside it to judge a refusal by (memleak, wake-cycle, poison): there an engine
    refusing the model's own dtype named explicitly is wrong (bug S1) on its own."""
    from kvdiag.checks.greedy import unsupported

    reason = refused(exc)
    if reason is not None:
        rec = unsupported(case, reason)
        rec.findings[-1].evidence["exception"] = type(exc).__name__
        wrong = refused_own_dtype(case, reason) if alone else None
        if wrong:
            rec.status = "fail"
            rec.add("error", "wrong", wrong)
        return rec
    return engine_failed(case, exc, "engine start")


def refused_own_dtype(case, reason: str) -> str | None:
    """Why refusing the case's kv dtype is wrong, else None: an explicit unquantized dtype equal to the model's
    dtype (its config's) is what ``auto`` stores (``drift.wrongly_refused`` judges the same against an auto case)."""
    from kvdiag.checks.sweep.drift import family
    from kvdiag.models import config_dtype

    own = config_dtype(case.model)
    if case.kv_dtype == "auto" or own is None or family(case.kv_dtype, own) != "identical":
        return None
    return f"explicit '{case.kv_dtype}' is the model's dtype (what 'auto' stores) but the engine refused it: {reason}"


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
    Detectors: ``memleak.holders`` (the referrer census that names what holds a surviving tensor),
    ``memleak.kv_identity`` (the KV cache's storages, known by identity, alive after shutdown)."""
    return name in os.environ.get(TEST_DISABLE_ENV, "").replace(" ", "").split(",")


def model_dtype(engine, case) -> str | None:
    """The dtype the weights run in (what ``auto`` stores the KV cache in)."""
    from kvdiag.engines.protocol import ModelFacts

    d = engine.dtype if isinstance(engine, ModelFacts) else None
    if d is not None and not callable(d):
        return str(d).removeprefix("torch.")
    return config_dtype(case.model)


def compiled(engine) -> bool:
    """Whether the engine runs a compiled model (vLLM's defaults; not with enforce_eager): drift.limits_for."""
    from kvdiag.engines.protocol import ModelFacts

    return isinstance(engine, ModelFacts) and bool(engine.compiled)
