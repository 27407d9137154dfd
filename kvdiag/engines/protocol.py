"""The runtime contract of an engine: the :class:`Engine` protocol every engine follows in a worker (start, generate,
score, sleep, wake_up, kv_blocks, versions, shutdown) and its data types, and the optional capabilities only some
engines have (``Replayable``, ``SharesWeights``, ``WorkerProcesses``, ...: runtime-checkable protocols, each saying
what a check does for an engine without it). A check asks for one with ``isinstance(engine, Capability)``, never
``getattr``; an engine declares the ones it has by subclassing them (``class MyEngine(Engine, PathProbes)``), and
tests/unit/test_engine_protocols.py holds every engine member a check reads to a protocol here.

What kvdiag asks an engine before any worker starts is its traits (``traits.py``); how an engine is found by name is
``base.py``, which re-exports the data types (``from kvdiag.engines.base import EngineSpec`` is how the rest of kvdiag
imports them; an engine's own modules import them from here, below the registry that names them). Nothing here
imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable


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
class ReportsFinished(Protocol):
    """An engine that says, while a ``generate`` or ``score`` call runs, how many of its requests have finished:
    it calls ``on_finished(n)`` with the running count where the caller set it (None: nobody listens). Engines
    without it report nothing until the call returns (the lm_eval adapter then says progress between calls)."""

    on_finished: Callable[[int], None] | None


@runtime_checkable
class Replayable(Protocol):
    """An engine that says how its last start can be repeated without kvdiag's checks (``kvdiag.proof``): a JSON-able
    dict with ``engine`` (its name) and what that engine's reproducer needs (vLLM: the ``LLM`` arguments, the extra
    SamplingParams and the ``VLLM_*`` environment; builtin: its ``EngineSpec`` without faults and the environment it
    read). Engines without it get no reproducer."""

    def replay_args(self) -> dict | None: ...


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


# ----------------------------------------------------------------------------------- optional capabilities
# Each: what it gives, which engines have it, and what a check does for an engine without it (the one fallback).


@runtime_checkable
class ModelFacts(Protocol):
    """What the engine runs since its start: the weights' dtype (a torch dtype or its name; None before a start),
    the tokens a request may hold, and whether the model is compiled (torch.compile: vLLM's defaults). builtin,
    vllm. Without it: the checkpoint's dtype, the case's ``max_model_len`` (else 2048), not compiled."""

    dtype: Any
    max_model_len: int
    compiled: bool


@runtime_checkable
class EndOfText(Protocol):
    """The tokenizer's end-of-text token id (None: it has none), which lm_eval stops on. builtin, vllm. Without
    it: the BOS token (``encode("")``) stands in."""

    eos_token_id: int | None


@runtime_checkable
class SharesWeights(Protocol):
    """Engines of one kind that share loaded weights in a process (builtin: the kv dtypes of ``--isolate run`` on
    threads): ``share_weights(other)`` takes ``other``'s weights (``other.has_weights()``) for its next start; a
    later ``start`` with the same weights re-creates only the KV cache; ``weight_loads`` counts reads from disk.
    Without it: one engine per case, and a second one (decoded drift's baseline) starts after the first is shut
    down."""

    weight_loads: int

    def has_weights(self) -> bool: ...

    def share_weights(self, other: Any) -> None: ...


@runtime_checkable
class HoldsAfterShutdown(Protocol):
    """Memory the engine keeps in this process outside Python objects after ``shutdown`` (vllm: the sleep-mode
    allocator's pool), ``[{"holder", "bytes", ...}]``, which memleak names. Without it: nothing is held."""

    def held_after_shutdown(self) -> list[dict]: ...


@runtime_checkable
class WorkerProcesses(Protocol):
    """An engine whose model and KV cache may live in worker processes of its own (vllm under tensor
    parallelism): whether they do now, ``fn(view, *args)`` run on each worker's shard of the cache, each worker's
    state (pid, GPU, KV storages, weight bytes; None where the model runner is in this process) and its allocator's
    cache emptied. Without it: the cache is in this process, reached through ``kv_blocks()``."""

    def kv_in_workers(self) -> bool: ...

    def on_kv(self, fn: Callable, *args: Any) -> list: ...

    def worker_states(self) -> list[dict] | None: ...

    def empty_worker_caches(self) -> None: ...


@runtime_checkable
class LayerSpecs(Protocol):
    """Each cache layer's kind as the engine itself declares it (vllm: its KV cache spec; None when out of reach),
    for the storage audit. Without it: the kinds are read from the ``kv_blocks()`` view."""

    def kv_layer_specs(self) -> list[dict] | None: ...


@runtime_checkable
class WeightBytes(Protocol):
    """Bytes of the model's weights where they live (vllm: in its worker processes too; None when unknown), which
    wake-cycle expects a sleep to free. Without it: the parameters of the torch modules the engine object holds."""

    def weight_bytes(self) -> int | None: ...


@runtime_checkable
class PathProbes(Protocol):
    """What the ``paths`` check asks of an engine (builtin, vllm): empty its prefix cache (False when a running
    request holds a block), its path counters since start (``prefix_hit_tokens``, ``preemptions``,
    ``prefill_chunks``, ...) and each preemption's point (prompt token ids, tokens generated then). Without it:
    nothing is reset, no path is confirmed by a counter, and a preemption has no recompute floor."""

    def reset_prefix_cache(self) -> bool: ...

    def path_counters(self) -> dict[str, int]: ...

    def preempted_at(self) -> list[tuple[tuple[int, ...], int]]: ...


@runtime_checkable
class CacheBlockSize(Protocol):
    """The tokens of one cache block as the engine runs it (vllm may raise the size asked: a hybrid's to its Mamba
    state's page), known without a view of the cache (None: not started). Without it: the ``kv_blocks()`` view's,
    else the size asked."""

    def cache_block_size(self) -> int | None: ...


@runtime_checkable
class GraphMode(Protocol):
    """The CUDA-graph mode the engine really runs (vllm may lower the one asked for; None: none or not started),
    recorded beside the graph paths. Without it: not recorded."""

    @property
    def cudagraph_mode(self) -> str | None: ...

