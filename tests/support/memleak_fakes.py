"""Test-only holders for kvdiag.measure.memory: tensors kept by a module global, an lru_cache keyed by a bound
method, a closure, a class attribute; a fake engine whose shutdown() forgets to drop its tensors; and plug-in
engines built on the builtin engine that keep their KV cache, or a small unrelated buffer, in a module dict."""

import functools

import torch

from kvdiag.engines.base import Capabilities, Completion
from kvdiag.engines.builtin.engine import BuiltinEngine
from kvdiag.engines.protocol import Engine, HoldsAfterShutdown

GLOBAL_LIST: list = []
CLOSURE = None


class Model(torch.nn.Module):
    def __init__(self, n: int = 64):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(n, n) for _ in range(2)])

    def forward(self, x):
        return x


@functools.lru_cache(maxsize=8)
def cached_by_method(forward):
    """Keyed by a bound method; the result holds nothing."""
    return 0


class Registry:
    scales = None


def make_closure(t):
    def reader():
        return t

    return reader


def fill(sizes: dict[str, int]) -> None:
    """Plant one holder of each kind, ``sizes`` in float32 elements (no reference stays with the caller)."""
    global CLOSURE
    GLOBAL_LIST.append(torch.zeros(sizes["global"]))
    cached_by_method(Model(sizes["model"]).forward)
    Registry.scales = torch.zeros(sizes["class"])
    CLOSURE = make_closure(torch.zeros(sizes["closure"]))


def clear() -> None:
    global CLOSURE
    GLOBAL_LIST.clear()
    cached_by_method.cache_clear()
    Registry.scales = None
    CLOSURE = None


class LeakyEngine(Engine):
    """An engine whose shutdown() keeps its KV tensor: only the engine object itself holds it. It generates, and
    refuses what memleak never asks."""

    name = "leaky"
    capabilities = Capabilities(kv_dtypes=("auto",))

    def start(self, spec):
        self.kv = torch.zeros(256, 1024)

    def encode(self, text):
        return [1]

    def decode(self, token_ids):
        return ""

    def generate(self, prompts, max_tokens, **kw):
        return [Completion([1], [2] * max_tokens, [0.0] * max_tokens) for _ in prompts]

    def score(self, contexts, continuations, *, top_k=0):
        raise NotImplementedError("a memleak fake scores nothing")

    def sleep(self, level):
        raise NotImplementedError("a memleak fake does not sleep")

    wake_up = sleep

    def kv_blocks(self):
        return None  # its tensor is out of kvdiag's view

    def versions(self):
        return {}

    def shutdown(self):
        pass  # forgets self.kv


PROCESS_CACHE: dict = {}


class ProcessCacheEngine(LeakyEngine):
    """An engine that fills a process-lifetime buffer cache once (as vLLM's ``_TRITON_BUFFER_CACHE``): the same
    small tensor survives every shutdown; nothing grows."""

    name = "process-cache"

    def start(self, spec):
        PROCESS_CACHE.setdefault("buffer", torch.zeros(16 * 1024))  # 64 KiB, created by the first start only

    def shutdown(self):
        pass


GROWING: list = []  # a leak that keeps one more KV-sized tensor after every shutdown


class CacheAndLeakEngine(ProcessCacheEngine):
    """The constant process cache and, beside it, a real leak: every start appends a 2 MiB tensor to a module list
    that nothing clears (the S4 class, small)."""

    name = "cache-and-leak"

    def start(self, spec):
        super().start(spec)
        GROWING.append(torch.zeros(512 * 1024))


class OnceEngine(LeakyEngine):
    """An engine that cannot start a second time in a process (vLLM's graph-pool assert, faked), whose plain restart
    (its ``reproducer`` for stage "restart", a fresh process) restarts or fails as ``OnceEngine.plain_ok`` says."""

    name = "once"
    started = False
    plain_ok = True
    ASSERT = "it->second->use_count > 0 INTERNAL ASSERT FAILED at CUDACachingAllocator.cpp"

    def start(self, spec):
        if OnceEngine.started:
            raise RuntimeError(self.ASSERT)
        OnceEngine.started = True

    @staticmethod
    def reproducer(stage, sleep_level=None):
        import shlex
        import sys

        body = "print('started again')" if OnceEngine.plain_ok else f"raise RuntimeError({OnceEngine.ASSERT!r})"
        return f"{shlex.quote(sys.executable)} -c {shlex.quote(body)}" if stage == "restart" else None


class FakeDevice:
    """CUDA memory as a fake device counts it (bytes), for engines whose memory no Python object shows."""

    allocated = reserved = peak = 0
    driver_base = 600 << 20

    @classmethod
    def reset(cls):
        cls.allocated = cls.reserved = cls.peak = 0

    @classmethod
    def add(cls, n: int):
        cls.allocated += n
        cls.reserved += n
        cls.peak = max(cls.peak, cls.allocated)


class SleepPoolEngine(LeakyEngine, HoldsAfterShutdown):
    """vLLM with sleep mode on CUDA, faked: the sleep-mode allocator is a process-wide singleton whose pool
    (``pool`` bytes) is never given back at shutdown, and a second start in the same process raises vLLM's
    assertion."""

    name = "sleep-pool"
    pool = 16 << 30
    started = False

    def start(self, spec):
        if SleepPoolEngine.started:
            raise AssertionError("CuMem allocator can only be used for one instance per process.")
        SleepPoolEngine.started = True
        FakeDevice.add(self.pool)

    def shutdown(self):
        pass  # the pool stays mapped

    def held_after_shutdown(self):
        return [{"holder": "vLLM's sleep-mode allocator pool (CuMemAllocator, a process-wide singleton)",
                 "bytes": self.pool, "tags": {"weights": 8 << 20, "kv_cache": self.pool - (8 << 20)}}]


def fake_cuda_snapshot(real):
    """kvdiag.measure.memory.snapshot with FakeDevice's counters as the CUDA measures."""

    def snap(stage, cycle, cuda=False, census=None, frozen=True):
        s = real(stage, cycle, False, census, frozen)
        s.cuda_allocated, s.cuda_reserved, s.cuda_peak = FakeDevice.allocated, FakeDevice.reserved, FakeDevice.peak
        s.driver_used = FakeDevice.driver_base + FakeDevice.reserved
        return s

    return snap


KEPT: dict = {}  # what the keeper engines keep after shutdown


class KVKeeperEngine(BuiltinEngine):
    """The builtin engine (a real KV view) whose shutdown() first puts its whole KV cache, every layer's k, v and
    scales, in a module dict; the next start replaces it: the same small cache survives every shutdown, nothing
    grows, all of it under the 64 MiB retention limit."""

    name = "kv-keeper"

    def shutdown(self):
        KEPT["kv"] = list(self.kv.layers) if self.kv is not None else None
        super().shutdown()


class BufferKeeperEngine(BuiltinEngine):
    """The same engine keeping one small unrelated buffer instead (48 KiB, created by the first start only): a
    process-lifetime cache, not the KV cache."""

    name = "buffer-keeper"

    def start(self, spec):
        super().start(spec)
        if "buffer" not in KEPT:
            KEPT["buffer"] = torch.zeros(12 * 1024)


class ScaleKeeperEngine(BuiltinEngine):
    """The builtin engine whose shutdown() keeps a side buffer sized like float32 per-token-head scales of its cache
    (1/32 of a bf16 cache: one float per 64-value head row), in a module dict; the next start replaces it, so the
    same buffer survives every shutdown and nothing grows (the issue-50 shape: 6% of zoo:qwen3's int8 cache)."""

    name = "scale-keeper"

    def shutdown(self):
        if self.kv is not None:  # start() shuts a running engine down first
            values = sum(t.numel() for layer in self.kv.layers for t in (layer.k, layer.v))
            KEPT["scales"] = torch.zeros(values // 64)
        super().shutdown()


class DiesInWorkloadEngine(LeakyEngine):
    """An engine that starts, then fails in its first generate as vLLM's compiled hybrid does on a GPU
    (docs/vllm-findings.md 14)."""

    name = "dies-in-workload"

    def generate(self, prompts, max_tokens, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
