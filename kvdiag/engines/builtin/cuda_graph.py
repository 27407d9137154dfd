"""CUDA graphs of the builtin engine's decode step (nano-vllm's ``capture_cudagraph``, captured lazily).

A decode step is 24-odd layers of small launches whose host time dwarfs their GPU time
(BENCHMARKS.md, round 2). On CUDA, the first decode step of each batch size runs once eagerly
through static input buffers (compiling and warming every kernel), is captured as a graph
into a pool the sizes share, then replayed; later steps of that size only copy their inputs
(token ids, positions, slots, sequence lengths, block tables: one int64 buffer, one copy
from pinned memory) and replay. Each batch size gets its own graph (no padding), and
attention splits have a fixed length (``kv_cache.SPLIT_TOKENS``), so a replay computes the
same bits as an eager step.

A graph freezes the addresses of the weights, the cache, its views and scales: the engine
drops its graphs whenever the cache is released (sleep, kv dtype switch, restart, shutdown;
:func:`release`), and a replay re-checks those addresses and re-captures when any moved.
Off with ``KVDIAG_CUDA_GRAPHS=0`` or ``--engine-arg cuda_graphs=0``; never on CPU.
"""

from __future__ import annotations

import os

import torch

from kvdiag.engines.builtin.kv_cache import AttnMetadata

ENV = "KVDIAG_CUDA_GRAPHS"
_OFF = ("0", "false", "no", "off")


def enabled(spec, device: torch.device) -> bool:
    """Whether decode steps on ``device`` are replayed from CUDA graphs (``spec`` None: the default)."""
    if device is None or device.type != "cuda":
        return False
    args = spec.engine_args if spec is not None else {}
    return str(args.get("cuda_graphs", os.environ.get(ENV, "1"))).strip().lower() not in _OFF


def for_engine(engine) -> DecodeGraphs | None:
    """The engine's decode graphs, created on first use; None where they are off."""
    if engine.graphs is None and enabled(engine.spec, engine.device):
        engine.graphs = DecodeGraphs(engine.model, engine.kv, engine.spec.max_num_seqs, engine.max_model_len)
    return engine.graphs


def release(graphs: DecodeGraphs | None) -> None:
    """Free ``graphs`` (their private memory pool goes back with the engine's next ``empty_cache``)."""
    if graphs is not None:
        graphs.clear()


class _Graph:
    """One batch size: the static inputs [ids | positions | slots | seq lens | tables bs x width], the graph
    and its output."""

    def __init__(self, bs: int, width: int, device: torch.device):
        self.bs, self.width = bs, width
        self.host = torch.zeros(bs * (4 + width), dtype=torch.int64, pin_memory=True)
        self.arr = self.host.numpy()
        self.inp = torch.zeros_like(self.host, device=device)
        self.qsl = torch.arange(bs + 1, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event()  # the pinned buffer is free again once its last copy ran
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def fill(self, ids, pos, slots, lens, tables) -> None:
        bs, w, a = self.bs, self.width, self.arr
        self.copied.synchronize()
        a[:bs], a[bs:2 * bs], a[2 * bs:3 * bs], a[3 * bs:4 * bs] = ids, pos, slots, lens
        for i, t in enumerate(tables):  # entries past a table's length are never read
            a[4 * bs + i * w:4 * bs + i * w + len(t)] = t
        self.inp.copy_(self.host, non_blocking=True)
        self.copied.record()

    @torch.inference_mode()
    def forward(self, model, kv) -> torch.Tensor:
        bs, i = self.bs, self.inp
        meta = AttnMetadata(i[2 * bs:3 * bs], self.qsl, i[3 * bs:4 * bs].to(torch.int32),
                            i[4 * bs:].view(bs, self.width).to(torch.int32))
        return model(i[:bs], i[bs:2 * bs], kv, meta)


class DecodeGraphs:
    def __init__(self, model, kv, max_batch: int, max_len: int):
        self.model, self.kv, self.max_batch = model, kv, max_batch
        self.width = -(-max_len // kv.block_size)
        self.device = kv.device
        self.pool = None
        self.graphs: dict[int, _Graph] = {}
        self.key = self._key()
        self.captures = self.replays = 0

    def _key(self) -> tuple:
        """Addresses a captured graph depends on (cache, views, scales, weights, rotary tables)."""
        kv, m = self.kv, self.model
        first = kv.views[0] if kv.views else None
        return (kv.layers[0].k.data_ptr(), first.k.data_ptr() if first is not None else 0, kv.k_scales.data_ptr(),
                m.rotary.cos.data_ptr(), m.model.embed_tokens.weight.data_ptr(),
                m.model.layers[-1].mlp.down_proj.weight.data_ptr())

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.max_batch

    def clear(self) -> None:
        for g in self.graphs.values():
            if g.graph is not None:
                g.graph.reset()
        self.graphs, self.pool = {}, None

    def run(self, ids, pos, slots, lens, tables) -> torch.Tensor:
        """Final hidden states [batch, hidden] of one decode step (a fresh tensor, not the graph's output)."""
        key = self._key()
        if key != self.key:  # something moved under the graphs: never replay them
            self.clear()
            self.key = key
        g = self.graphs.get(len(ids))
        if g is None:
            g = self.graphs[len(ids)] = _Graph(len(ids), self.width, self.device)
            g.fill(ids, pos, slots, lens, tables)
            self._capture(g)
        else:
            g.fill(ids, pos, slots, lens, tables)
        g.graph.replay()
        self.replays += 1
        return g.out.clone()

    def _capture(self, g: _Graph) -> None:
        g.forward(self.model, self.kv)  # warm-up: compiles and caches every launch of this shape
        torch.cuda.synchronize(self.device)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out = g.forward(self.model, self.kv)
        self.captures += 1
