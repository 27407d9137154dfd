"""Test-only holders for kvdiag.memory: tensors kept by a module global, an lru_cache keyed by a bound
method, a closure, a class attribute; and a fake engine whose shutdown() forgets to drop its tensors."""

import functools

import torch

from kvdiag.engines.base import Capabilities, Completion

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


class LeakyEngine:
    """An engine whose shutdown() keeps its KV tensor: only the engine object itself holds it."""

    name = "leaky"
    capabilities = Capabilities(kv_dtypes=("auto",))

    def start(self, spec):
        self.kv = torch.zeros(256, 1024)

    def generate(self, prompts, max_tokens, **kw):
        return [Completion([1], [2] * max_tokens, [0.0] * max_tokens) for _ in prompts]

    def shutdown(self):
        pass  # forgets self.kv
