"""BuiltinEngine: kvdiag's own paged-KV engine, the default engine of every command.

One process, one model: ``start`` loads weights once (a later ``start`` with the same
model, weights dtype, device and length, or :meth:`set_kv_dtype`, only re-creates the
KV cache), ``generate`` runs prefill/decode over the paged cache with a free-list block
allocator (its scheduling and the KV paths prefix caching, preemption and chunked prefill:
``scheduler.py``), ``score`` prefills each distinct context once and forks its blocks for every
continuation. Sleep level 1 keeps weights (on CPU) and drops the cache; level 2 drops
both; ``wake_up`` re-allocates and rebuilds every derived table.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import Sequence

import torch

from kvdiag import dtypes
from kvdiag.engines.builtin import cuda_graph, loader
from kvdiag.engines.builtin.arg_names import SPEC_ARGS, engine_arg_names
from kvdiag.engines.builtin.block_manager import BlockManager
from kvdiag.engines.builtin.config import ModelConfig
from kvdiag.engines.builtin.faults import PATH_FAULTS, Faults
from kvdiag.engines.builtin.kv_cache import AttnMetadata, KVCache
from kvdiag.engines.builtin.model import Rows
from kvdiag.engines.builtin.sampling import score_rows
from kvdiag.engines.builtin.scheduler import Scheduler, Seq
from kvdiag.engines.protocol import (
    Capabilities,
    Completion,
    EndOfText,
    Engine,
    EngineSpec,
    KVBlockView,
    ModelFacts,
    PathProbes,
    Replayable,
    Scored,
    SharesWeights,
)
from kvdiag.errors import UserError

_WEIGHT_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                  "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
TAGS = ("weights", "kv_cache")
TOKEN_BUDGET, CPU_TOKEN_BUDGET = 8192, 2048  # default new tokens per forward pass (_token_budget)
PATH_COUNTERS = ("prefix_hit_tokens", "evicted_blocks", "preemptions", "prefill_chunks", "cuda_graph_replays",
                 "connector_loaded_tokens")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device '{name}' requested but CUDA is not available")
    return torch.device(name)


def _replay(spec: EngineSpec) -> dict | None:
    """``replay_args`` of a start with ``spec``; None where an engine argument is not JSON."""
    import json
    import os
    from dataclasses import asdict

    env = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    if cuda_graph.ENV in os.environ:
        env[cuda_graph.ENV] = os.environ[cuda_graph.ENV]
    out = {"engine": "builtin", "spec": {k: v for k, v in asdict(spec).items() if k != "faults"}, "env": env}
    try:
        return json.loads(json.dumps(out))
    except (TypeError, ValueError):
        return None


class BuiltinEngine(Engine, ModelFacts, EndOfText, SharesWeights, PathProbes, Replayable):
    name = "builtin"
    compiled = False  # eager modules (decode steps may replay CUDA graphs), never torch.compile

    def __init__(self):
        self.spec: EngineSpec | None = None
        self.cfg: ModelConfig | None = None
        self.model = self.tokenizer = self.kv = self.blocks = self.path = self.device = self.dtype = None
        self.kv_scales: tuple[list[float], list[float]] | None = None  # checkpoint per-layer fp8 scales
        self.faults = Faults()
        self.asleep = dict.fromkeys(TAGS, 0)  # sleep level of each part, 0 = awake
        self.max_model_len = 0
        self.weight_loads = 0  # how many times weights were read from disk
        self._weights_key = None
        self.graphs: cuda_graph.DecodeGraphs | None = None  # decode CUDA graphs, dropped with the cache
        self.counters = dict.fromkeys(PATH_COUNTERS, 0)  # path_counters()
        self.preempted: list[tuple[tuple[int, ...], int]] = []  # preempted_at()
        self.fault_fired = dict.fromkeys(PATH_FAULTS, 0)  # how often each KV-path fault fired since start
        self._replay: dict | None = None  # replay_args(): the last start's spec and environment, JSON-able

    @staticmethod
    def supported_kv_dtypes() -> list[str]:
        return list(dtypes.BUILTIN_DTYPES)

    engine_arg_names = staticmethod(engine_arg_names)  # what -a takes, without starting it

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(kv_dtypes=tuple(self.supported_kv_dtypes()), sleep_levels=(1, 2), kv_access=True,
                            full_logits=True, max_logprobs=self.cfg.vocab_size if self.cfg else 20)

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self, spec: EngineSpec) -> None:
        self._replay = _replay(spec)
        if own := {k: v for k, v in spec.engine_args.items() if k in SPEC_ARGS}:  # -a kv_cache_memory=8589934592
            spec = replace(spec, **own)
        kv_dtype = dtypes.resolve(spec.kv_cache_dtype, self.supported_kv_dtypes())
        faults = Faults.parse(spec.faults)
        faults.check_kv_dtype(kv_dtype)  # fault explicit_bf16_rejected; nothing otherwise
        device = _device(spec.device)
        path = loader.resolve_model_path(spec.model)
        cfg = ModelConfig.from_path(path)
        name = cfg.torch_dtype if spec.dtype == "auto" else spec.dtype
        if name not in _WEIGHT_DTYPES:
            raise UserError(f"unknown weights dtype '{spec.dtype}'; valid: auto, bfloat16, float16, float32")
        dtype = _WEIGHT_DTYPES[name]
        max_len = min(spec.max_model_len, cfg.max_position_embeddings, cfg.sliding_window or 1 << 62)
        key = (str(path.resolve()), dtype, device, max_len)
        if self.model is None or key != self._weights_key or any(self.asleep.values()):
            self.shutdown()
            self.cfg, self.path, self.device, self.dtype, self.max_model_len = cfg, path, device, dtype, max_len
            self.model = loader.build_model(cfg, path, dtype, device, max_len)
            self.weight_loads += 1
            self.tokenizer = loader.load_tokenizer(path)
            self.kv_scales = loader.load_kv_scales(path, cfg.num_layers)
            self._weights_key = key
        else:
            self._release_kv()
        self.spec, self.faults = replace(spec, kv_cache_dtype=kv_dtype), faults
        self.counters, self.fault_fired = dict.fromkeys(PATH_COUNTERS, 0), dict.fromkeys(PATH_FAULTS, 0)
        self.preempted = []
        self._allocate_kv()
        self.faults.on_start(self)  # memleak faults (faults.py); nothing when none is set

    def replay_args(self) -> dict | None:
        """How the last start can be repeated with this engine's public API alone (``protocol.Replayable``; a
        reproducer's ``BuiltinEngine().start(EngineSpec(**spec))``): the spec as ``start`` got it, without its
        faults (a self-test's fault goes into a reproducer by its patch, ``faults.apply``), and the environment it
        read: the torch threads of this process (a CPU sum's order follows them) and ``KVDIAG_CUDA_GRAPHS``."""
        return self._replay

    def share_weights(self, other: "BuiltinEngine") -> None:
        """Use the weights ``other`` loaded (the same modules, no copy; the forward pass changes nothing in them):
        this engine's next :meth:`start` with the same model, weights dtype, device and length keeps them. For
        several kv dtypes at once in one process (``accuracy --isolate run`` on the CPU). The tokenizer is this
        engine's own: a fast tokenizer is not safe to share between threads."""
        other._check_ready()
        self.shutdown()
        self.cfg, self.path, self.device, self.dtype = other.cfg, other.path, other.device, other.dtype
        self.model, self.kv_scales, self._weights_key = other.model, other.kv_scales, other._weights_key
        self.max_model_len = other.max_model_len
        self.tokenizer = loader.load_tokenizer(other.path)

    def has_weights(self) -> bool:
        """Whether its weights are loaded now (another engine may take them: ``share_weights``)."""
        return self.model is not None

    def set_kv_dtype(self, kv_cache_dtype: str) -> None:
        """Re-create the KV cache for another kv dtype, keeping the loaded weights."""
        self._check_ready()
        self.start(replace(self.spec, kv_cache_dtype=kv_cache_dtype))

    def _allocate_kv(self, rebuild_tables: bool = True) -> None:
        spec, cfg = self.spec, self.cfg
        kv_dtype = self.faults.kv_path(spec.kv_cache_dtype)  # spec's dtype, unless explicit_bf16_misdispatch
        if self.kv is None:
            per_block = KVCache.block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, spec.block_size,
                                            kv_dtype, self.dtype)
            num_blocks = spec.num_blocks or spec.kv_cache_memory // per_block
            if num_blocks < 1:
                raise UserError(f"kv_cache_memory {spec.kv_cache_memory} B holds no block of {per_block} B")
            self.kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, spec.block_size, num_blocks,
                              kv_dtype, self.dtype, self.device)
        self.kv.whole_page_reads = self.faults.whole_page_reads
        self.kv.v_with_k_scales = self.faults.v_with_k_scales
        ones = [1.0] * cfg.num_layers
        self.kv.allocate(*(self.kv_scales or (ones, ones)))
        if rebuild_tables:
            self.kv.build_tables()
        on_fresh = None if self.faults.no_zero_fresh_blocks else self.kv.zero
        stale = self.faults.evicted_block_keeps_hash
        self.blocks = BlockManager(self.kv.num_blocks, spec.block_size, on_fresh, self.kv.copy_block,
                                   on_evict=lambda _: self._evicted(stale), stale_hashes=stale)

    def _evicted(self, stale: bool) -> None:
        self.counters["evicted_blocks"] += 1
        self.fault_fired["evicted_block_keeps_hash"] += int(stale)

    def _release_kv(self, keep_tables: bool = False) -> None:
        self.graphs = cuda_graph.release(self.graphs)  # they hold the cache's and the weights' addresses
        if self.kv is not None:
            self.kv.release(keep_tables)
            if not keep_tables:
                self.kv = None
        self.blocks = None

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        self._check_ready()
        self._release_kv(keep_tables=self.faults.stale_views_after_wake)
        if level == 1:
            if self.device.type != "cpu":
                self.model.to("cpu")
        else:
            self.model, self.kv_scales = None, None
        self.asleep = dict.fromkeys(TAGS, level)
        self._collect()

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(TAGS) if tags is None else list(tags)
        if unknown := [t for t in tags if t not in TAGS]:
            raise ValueError(f"unknown wake_up tag(s) {unknown}; valid: {', '.join(TAGS)}")
        if "weights" in tags and self.asleep["weights"]:
            if self.asleep["weights"] == 1:
                self.model.to(self.device)
                self.model.rotary.build()
            else:
                self.model = loader.build_model(self.cfg, self.path, self.dtype, self.device, self.max_model_len)
                self.weight_loads += 1
            self.asleep["weights"] = 0
        if "kv_cache" in tags and self.asleep["kv_cache"]:
            if self.asleep["kv_cache"] == 2:
                self.kv_scales = loader.load_kv_scales(self.path, self.cfg.num_layers)
                if self.faults.fp8_scales_lost_on_wake:
                    self.kv_scales = ([0.0] * self.cfg.num_layers, [0.0] * self.cfg.num_layers)
            self._allocate_kv(rebuild_tables=not self.faults.stale_views_after_wake)
            self.asleep["kv_cache"] = 0

    def shutdown(self) -> None:
        self._release_kv()
        self.model = self.kv = self.blocks = self.kv_scales = self.tokenizer = None
        self._weights_key = None
        self.asleep = dict.fromkeys(TAGS, 0)
        self._collect()

    def _collect(self) -> None:
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_ready(self) -> None:
        if self.model is None and not any(self.asleep.values()):
            raise RuntimeError("engine not started")
        if any(self.asleep.values()):
            raise RuntimeError(f"engine is asleep ({self.asleep}); call wake_up() first")

    # ----- introspection ---------------------------------------------------------------------
    def kv_blocks(self) -> KVBlockView | None:
        if self.kv is None or not self.kv.allocated or self.blocks is None:
            return None
        return KVBlockView(self.kv.block_size, self.kv.num_blocks, list(self.kv.layers),
                           self.blocks.free_blocks, self.blocks.used_blocks)

    def path_counters(self) -> dict[str, int]:
        """Since ``start``: ``prefix_hit_tokens`` (prompt tokens not computed because their blocks were cached),
        ``evicted_blocks`` (cached blocks handed out again, their hash dropped), ``preemptions``, ``prefill_chunks``
        (prefill entries of a prompt whose prefill spans several entries, every one of them counted),
        ``cuda_graph_replays`` (decode steps replayed from a CUDA graph) and ``connector_loaded_tokens`` (prompt
        tokens loaded from the KV connector, ``-a kv_connector_dir``)."""
        return dict(self.counters)

    def preempted_at(self) -> list[tuple[tuple[int, ...], int]]:
        """Since ``start``, each preemption: (the request's prompt token ids, tokens it had generated then)."""
        return list(self.preempted)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (as vLLM's ``reset_prefix_cache``): False, forgetting nothing, while a running
        sequence holds one; between ``generate`` calls nothing runs, so True."""
        self._check_ready()
        return self.blocks.reset_cache()

    def versions(self) -> dict[str, str]:
        import transformers

        from kvdiag.kernels import dispatch
        from kvdiag.version import __version__

        device = self.device or torch.device("cpu")
        return {"kvdiag": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "device": str(device), "kernels": dispatch.backend("paged_attention", device)}

    # ----- tokens ------------------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _ids(self, x, special: bool) -> list[int]:
        ids = self.tokenizer.encode(x, add_special_tokens=special) if isinstance(x, str) else [int(t) for t in x]
        if ids and (min(ids) < 0 or max(ids) >= self.cfg.vocab_size):
            raise UserError(f"token id out of range [0, {self.cfg.vocab_size}) in {ids[:8]}...")
        return ids

    @property
    def _batched_tokens(self) -> int:
        """``-a max_num_batched_tokens=N`` as given (at least 1). Default 8192; 2048 on the CPU, where smaller
        activations stay in cache (docs/DESIGN.md, "Engines"). Only chunked prefill uses it unclamped."""
        default = CPU_TOKEN_BUDGET if self.device.type == "cpu" else TOKEN_BUDGET
        return max(int(self.spec.engine_args.get("max_num_batched_tokens", default)), 1)

    @property
    def _token_budget(self) -> int:
        """New tokens per forward pass, at least one whole context: a prompt or context is prefilled whole."""
        return max(self._batched_tokens, self.max_model_len)

    def _fits(self, num_tokens: int, what: str) -> None:
        if num_tokens > self.max_model_len:
            raise UserError(f"{what} of {num_tokens} tokens exceeds max_model_len {self.max_model_len}")
        if self.blocks.blocks_for(num_tokens) > self.kv.num_blocks:
            raise UserError(f"{what} of {num_tokens} tokens needs {self.blocks.blocks_for(num_tokens)} KV blocks; "
                            f"the cache has {self.kv.num_blocks} (raise num_blocks or kv_cache_memory)")

    # ----- forward -----------------------------------------------------------------------------
    def _forward(self, entries, last_only: bool = False, own_context=()) -> tuple[torch.Tensor, list[int]]:
        """Run packed new tokens. ``entries``: (block table, first position, new token ids).
        Returns final hidden states [num_new_tokens, hidden] (``last_only``: [num_entries, hidden], each
        entry's last token) and query_start_loc. ``own_context``: indices of entries whose attention sequence
        length counts their own tokens only (the fault chunk_context_dropped)."""
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for i, (table, start, toks) in enumerate(entries):
            ids += toks
            pos += range(start, start + len(toks))
            slots += self.blocks.slots(table, start, start + len(toks))
            qsl.append(qsl[-1] + len(toks))
            lens.append(len(toks) if i in own_context else start + len(toks))
        if len(ids) == len(entries) and (graphs := cuda_graph.for_engine(self)) and graphs.fits(len(ids)):
            self.counters["cuda_graph_replays"] += 1
            return graphs.run(ids, pos, slots, lens, [t for t, _, _ in entries]), qsl  # decode: replay a graph
        width = max(len(t) for t, _, _ in entries)
        tables = [t + [0] * (width - len(t)) for t, _, _ in entries]
        dev = self.device
        meta = AttnMetadata(torch.tensor(slots, dtype=torch.int64, device=dev),
                            torch.tensor(qsl, dtype=torch.int32, device=dev),
                            torch.tensor(lens, dtype=torch.int32, device=dev),
                            torch.tensor(tables, dtype=torch.int32, device=dev))
        rows = Rows.last_of_each(meta) if last_only else None
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), self.kv, meta, rows)
        return hidden, qsl

    # ----- generate ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], max_tokens: int, *, greedy: bool = True,
                 logprobs: int = 0, seed: int | None = None, stop: Sequence[str] = ()) -> list[Completion]:
        self._check_ready()
        eos = set(self.cfg.eos_token_ids) | {self.tokenizer.eos_token_id} - {None}
        if self.spec.engine_args.get("ignore_eos"):  # --engine-arg ignore_eos=1: always max_tokens
            eos = set()
        reqs = [Seq(self._ids(p, True), max_tokens, eos, tuple(stop), self.decode,
                    None if greedy else (self.spec.seed if seed is None else seed)) for p in prompts]
        for r in reqs:
            if not r.prompt:
                raise UserError("empty prompt")
            self._fits(len(r.prompt), "prompt")
            self._fits(min(len(r.prompt) + max(max_tokens, 0), self.max_model_len), "prompt plus max_tokens")
        Scheduler(self, max_tokens, logprobs).run(reqs)
        return [r.completion(logprobs) for r in reqs]

    # ----- score -------------------------------------------------------------------------------
    def score(self, contexts: Sequence[str | Sequence[int]], continuations: Sequence[str | Sequence[int]], *,
              top_k: int = 0) -> list[Scored]:
        self._check_ready()
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        ctxs = [tuple(self._ids(c, True)) for c in contexts]
        conts = [self._ids(c, False) for c in continuations]
        groups: dict[tuple, list[int]] = {}
        results: list[Scored | None] = [None] * len(ctxs)
        for i, (ctx, cont) in enumerate(zip(ctxs, conts)):
            if not ctx:
                raise UserError("score needs a non-empty context (the first continuation token has no logits)")
            self._fits(len(ctx) + len(cont) - 1, "context plus continuation")
            if cont:
                groups.setdefault(ctx, []).append(i)
            else:
                results[i] = Scored(logprobs=[], is_greedy=True, top_logprobs=[] if top_k > 0 else None)
        items = list(groups.items())
        i = 0
        while i < len(items):
            j = self._take_contexts(items, i, conts)
            self._score_contexts(items[i:j], conts, results, top_k)
            i = j
        return results

    def _extra_blocks(self, n: int, cont: list[int]) -> int:
        """Blocks a fork of an n-token context needs beyond the shared full ones to run cont[:-1]."""
        return self.blocks.blocks_for(n + len(cont) - 1) - n // self.kv.block_size if len(cont) > 1 else 0

    def _take_contexts(self, items, i: int, conts) -> int:
        used = extra = tokens = 0
        j = i
        while j < len(items) and j - i < self.spec.max_num_seqs:
            ctx, reqs = items[j]
            need, ex = self.blocks.blocks_for(len(ctx)), max(self._extra_blocks(len(ctx), conts[r]) for r in reqs)
            if used + need + max(extra, ex) > self.blocks.num_free or tokens + len(ctx) > self._token_budget:
                if j == i:
                    raise UserError(f"a context of {len(ctx)} tokens plus a continuation needs {need + ex} KV "
                                    f"blocks; the cache has {self.kv.num_blocks}")
                break
            used, extra, tokens, j = used + need, max(extra, ex), tokens + len(ctx), j + 1
        return j

    def _score_contexts(self, batch, conts, results, top_k: int) -> None:
        tables = [self.blocks.grow([], len(ctx)) for ctx, _ in batch]
        first, _ = self._forward([(t, 0, list(ctx)) for t, (ctx, _) in zip(tables, batch)], last_only=True)
        work = [(g, r) for g, (_, reqs) in enumerate(batch) for r in reqs if len(conts[r]) > 1]
        rest: dict[int, torch.Tensor] = {}
        j = 0
        while j < len(work):
            chunk, tokens = [], 0
            while j < len(work) and len(chunk) < self.spec.max_num_seqs:
                g, r = work[j]
                n, m = len(batch[g][0]), len(conts[r])
                if chunk and (self._extra_blocks(n, conts[r]) > self.blocks.num_free or
                              tokens + m - 1 > self._token_budget):
                    break
                chunk.append((g, r, self.blocks.grow(self.blocks.fork(tables[g], n), n + m - 1)))
                tokens, j = tokens + m - 1, j + 1
            h, q = self._forward([(t, len(batch[g][0]), conts[r][:-1]) for g, r, t in chunk])
            for k, (g, r, t) in enumerate(chunk):
                rest[r] = h[q[k]:q[k + 1]]
                self.blocks.free(t)
        for g, (_, reqs) in enumerate(batch):
            for r in reqs:
                rows = first[g:g + 1] if r not in rest else torch.cat([first[g:g + 1], rest[r]])
                results[r] = score_rows(self.model.logits(rows), conts[r], top_k)
        for t in tables:
            self.blocks.free(t)
