"""What every check's cases are made of, validated before any worker starts (bad input: UserError, exit 2): a
``Target`` (engine, model, kv dtypes, device, engine arguments, faults, isolation) resolved, and a sweep against a
baseline dtype (accuracy, dtypes). ``registry.check_cases`` is the one entry the commands and `kvdiag ci` call."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.engines.args import parse_engine_args
from kvdiag.errors import UserError

SHIPPED_MODEL = "tiny-llama"


def default_model() -> str:
    from kvdiag.assets import TINY_MODEL

    return str(TINY_MODEL)


def resolve_model(model: str | None) -> str:
    """The shipped model when None, else a checked local folder: the folder given, or a hub id's snapshot in the
    Hugging Face cache (kvdiag.models). Resolved here, once, so that the workers only see a folder."""
    if model is None:
        return default_model()
    from kvdiag.checks.accuracy.harness.lm_eval_options import refuse_backend
    from kvdiag.models import resolve

    refuse_backend(model)

    return resolve(model)


def engine_model(engine: str, model: str | None) -> str:
    """:func:`resolve_model`, and the model checked by the engine's traits where they can say before it starts
    (``model_problem``: the builtin engine, a family it does not implement), so that a model it does not run is one
    line and exit 2 before any worker starts."""
    folder = resolve_model(model)
    if model is not None:
        from kvdiag.engines.base import engine_traits

        if why := engine_traits(engine).model_problem(folder):
            raise UserError(f"model {model}: {why}")
    return folder


def resolve_kv_dtypes(engine: str, user: list[str] | None, *, default_all: bool = True) -> list[str]:
    from kvdiag import dtypes
    from kvdiag.engines.base import engine_dtypes, resolve_engine

    engine = resolve_engine(engine)
    valid = engine_dtypes(engine)
    if not user:
        return dtypes.sweep_names(valid) if default_all else ["auto"]
    out = []
    for u in user:
        for part in u.split(","):
            if part.strip():
                name = dtypes.resolve(part, valid, engine)
                if name not in out:
                    out.append(name)
    return out


def resolve_faults(engine: str, names: list[str] | None) -> list[str]:
    """--fault names, validated by the engine's traits (UserError otherwise): the builtin engine's with their aliases
    expanded; another engine's from its self-test catalogue (vLLM's re-introduced fixed bugs,
    ``kvdiag selftest -e vllm --list``)."""
    if not names:
        return []
    from kvdiag.engines.base import engine_traits

    return engine_traits(engine).resolve_faults(engine, names)


@dataclass
class Target:
    """What a check's cases run on, as the user gave it (validated by the builders): the engine, the model (None:
    the shipped one), the kv dtypes (None: every dtype the engine supports), the device, ``key=value`` engine
    arguments, builtin-engine faults, and whether the cases share one worker (``isolate="run"``)."""

    engine: str = "builtin"
    model: str | None = None
    kv_dtypes: list[str] | None = None
    device: str = "auto"
    engine_args: list[str] | None = None
    faults: list[str] | None = None
    isolate: str = "case"

    def __post_init__(self):
        self.isolate = getattr(self.isolate, "value", self.isolate)  # the CLI's Isolate enum
        self.device = check_device(self.device)


DEVICES = ("auto", "cpu", "cuda")  # and cuda:N


def check_device(device: str) -> str:
    """``device`` where it is one kvdiag runs on (UserError, before any worker starts, where not)."""
    head, _, index = str(device).partition(":")
    if device in DEVICES or head == "cuda" and index.isdigit():
        return device
    raise UserError(f"--device '{device}': expected auto, cpu, cuda or cuda:N")


@dataclass
class Sweep:
    engine: str
    model: str
    kv_dtypes: list[str]  # the baseline first
    baseline: str
    spec: dict  # EngineSpec fields for case.params


def resolve_sweep(target: Target, baseline: str, *, all_names=False) -> Sweep:
    """Validate everything a sweep needs before any worker starts (bad input: UserError, exit 2)."""
    from kvdiag import dtypes
    from kvdiag.engines.base import check_engine_args, engine_dtypes, resolve_engine
    from kvdiag.errors import UserError

    engine = resolve_engine(target.engine)
    engine_args = check_engine_args(engine, parse_engine_args(target.engine_args))
    model = engine_model(engine, target.model)
    valid = engine_dtypes(engine)
    names = resolve_kv_dtypes(engine, target.kv_dtypes) if target.kv_dtypes or not all_names else list(valid)
    try:
        base = dtypes.resolve(baseline, valid, engine)
    except UserError as e:
        raise UserError(f"--baseline: {e}") from None
    spec = {"device": target.device, "engine_args": engine_args, "faults": resolve_faults(engine, target.faults)}
    return Sweep(engine, model, [base] + [d for d in names if d != base], base, spec)


def sweep_cases(check: str, sweep: Sweep, params: dict, isolate) -> list:
    """One case per dtype of the sweep, the baseline first (role 'baseline'), the others 'test'."""
    from kvdiag.case import Case
    from kvdiag.models import label

    group = check if isolate == "run" else None
    name = label(sweep.model)  # a hub snapshot's repo name, not its commit hash
    return [Case(check, sweep.engine, sweep.model, d, group=group, id=f"{check}/{sweep.engine}/{name}/{d}",
                 params={**sweep.spec, **params, "role": "baseline" if d == sweep.baseline else "test"})
            for d in sweep.kv_dtypes]


