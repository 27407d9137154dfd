"""Who holds the tensors that survived: referrer chains from each survivor up to a root a person recognises.

One breadth-first walk over ``gc.get_referrers`` starts from every surviving tensor at
once (every tensor object of a storage: views share it) and stops at roots: a module
global, a class attribute, a ``functools.lru_cache`` (the cached function, and what its
key or result holds), a closure or default argument of a function, a live frame outside
kvdiag, or an object the caller names (the engine after ``shutdown()``). kvdiag's own
frames and the walk's own containers are ignored. A storage with no chain is
"invisible: frozen by gc.freeze()" while objects are frozen (gc cannot see them), else
unattributed. Holders are grouped by root and ranked by bytes.
"""

from __future__ import annotations

import functools
import gc
import re
import sys
import types
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvdiag.measure.memory import MiB, live_tensors, storage_key

MAX_DEPTH = 48
MAX_NODES = 50_000
FROZEN = "invisible: frozen by gc.freeze()"
UNATTRIBUTED = "unattributed: no chain to a global, lru_cache, closure, class attribute or frame (held from C++?)"
KVDIAG_DIR = str(Path(__file__).resolve().parent)


@dataclass
class Holder:
    holder: str  # the root, as a person reads it
    path: str  # an access path from the root to the largest tensor it holds
    chain: list[str] = field(default_factory=list)  # each step: how it is held -> what it is
    bytes: int = 0
    count: int = 0  # storages
    tensors: int = 0  # tensor objects (views included)
    largest: int = 0  # bytes of its largest storage

    def to_json(self) -> dict:
        return {"holder": self.holder, "path": self.path, "chain": self.chain, "bytes": self.bytes,
                "mib": round(self.bytes / MiB, 3), "count": self.count, "tensors": self.tensors,
                "largest_mib": round(self.largest / MiB, 3)}


def holders(keys, named_roots: dict[int, str] | None = None, max_depth: int = MAX_DEPTH) -> list[Holder]:
    """Group the tensors with census ``keys`` by what holds them, largest first."""
    return holders_of([keys], named_roots, max_depth)[0]


def holders_of(key_sets: list, named_roots: dict[int, str] | None = None,
               max_depth: int = MAX_DEPTH) -> list[list[Holder]]:
    """``holders`` of each set of census keys, from one walk over them all (each level of a walk is a
    ``gc.get_referrers`` over every object: the costly part)."""
    keys = set().union(*key_sets)
    if not keys:
        return [[] for _ in key_sets]
    sources = live_tensors(keys)
    census = {(id(t), *st[:2]): st for t in sources for st in (storage_key(t),)}  # no references: ids and sizes
    walk = _Walk(named_roots or {}, ignore={id(sources)})
    walk.run(tuple(sources), max_depth)
    paths = {key: walk.path(key[0]) for key in census}
    nodes = {i: walk.nodes[i] for path in paths.values() if path for i in path}
    named = walk.named
    del sources, walk
    out = [_grouped([(census[k], paths[k]) for k in ks if k in census], nodes, named) for ks in key_sets]
    del nodes
    return out


def _grouped(found: list, nodes: dict, named: dict) -> list[Holder]:
    """Holders from (storage key, path or None) per tensor: each storage under its shortest path, grouped by root."""
    best: dict[tuple, tuple[int, list | None]] = {}  # storage -> (bytes, shortest path)
    counts: dict[tuple, int] = {}
    for st, path in found:
        counts[st[:2]] = counts.get(st[:2], 0) + 1
        old = best.get(st[:2])
        if old is None or (path is not None and (old[1] is None or len(path) < len(old[1]))):
            best[st[:2]] = (st[2], path)
    groups: dict[str, Holder] = {}
    fallback = FROZEN if gc.get_freeze_count() > 0 else UNATTRIBUTED
    for st, (nbytes, path) in sorted(best.items(), key=lambda kv: -kv[1][0]):
        holder, expr, chain = describe([nodes[i] for i in path], named) if path else (fallback, "?", [])
        h = groups.setdefault(holder, Holder(holder, expr, chain))
        h.bytes += nbytes
        h.largest = max(h.largest, nbytes)
        h.count += 1
        h.tensors += counts[st]
    return sorted(groups.values(), key=lambda h: -h.bytes)


class _Walk:
    """Breadth-first over gc.get_referrers from all sources at once, recording child -> referrer edges."""

    def __init__(self, named: dict[int, str], ignore: set[int]):
        self.named = named
        self.nodes: dict[int, object] = {}
        self.up: dict[int, list[int]] = {}
        self.roots: set[int] = set()
        self.module_dicts = {id(vars(m)): n for n, m in list(sys.modules.items()) if hasattr(m, "__dict__")}
        self.ignore = ignore | {id(self.nodes), id(self.__dict__)}
        self.frames = [f for f in _live_frames() if not f.f_code.co_filename.startswith(KVDIAG_DIR)]

    def run(self, frontier: tuple, max_depth: int) -> None:
        self.nodes.update((id(o), o) for o in frontier)
        for _ in range(max_depth):
            if not frontier or len(self.nodes) > MAX_NODES:
                break
            frontier = self._level(frontier)

    def _level(self, frontier: tuple) -> tuple:
        ids = {id(o) for o in frontier}
        found = gc.get_referrers(*frontier)
        skip = self.ignore | {id(frontier), id(found)}
        nxt = []
        for r in found:
            if id(r) in skip or (isinstance(r, types.FrameType) and r.f_code.co_filename.startswith(KVDIAG_DIR)):
                continue
            for c in gc.get_referents(r):
                if id(c) in ids:
                    self.up.setdefault(id(c), []).append(id(r))
            if id(r) not in self.nodes:
                self.nodes[id(r)] = r
                if self.is_root(r):
                    self.roots.add(id(r))
                else:
                    nxt.append(r)
        for f in self.frames:  # running frames hold their locals outside gc's sight
            held = [v for v in f.f_locals.values() if id(v) in ids]
            for v in held:
                self.up.setdefault(id(v), []).append(id(f))
            if held and id(f) not in self.nodes:
                self.nodes[id(f)] = f
                self.roots.add(id(f))
        return tuple(nxt)

    def is_root(self, r) -> bool:
        return (id(r) in self.named or id(r) in self.module_dicts
                or isinstance(r, (type, types.ModuleType, types.FunctionType, types.FrameType,
                                  functools._lru_cache_wrapper)))

    def path(self, source: int) -> list[int] | None:
        """The shortest recorded chain [root, ..., source]."""
        down = {source: None}
        queue = deque([source])
        while queue:
            n = queue.popleft()
            if n in self.roots:
                out = [n]
                while down[out[-1]] is not None:
                    out.append(down[out[-1]])
                return out
            for r in self.up.get(n, ()):
                if r not in down:
                    down[r] = n
                    queue.append(r)
        return None


def _live_frames() -> list:
    """The frames every thread is running now, innermost first."""
    out = []
    for top in sys._current_frames().values():
        f = top
        while f is not None:
            out.append(f)
            f = f.f_back
    return out


def describe(objs: list, named: dict[int, str] | None = None) -> tuple[str, str, list[str]]:
    """(holder, access path, chain) for a chain of objects [root, ..., tensor]."""
    holder, expr, start = root_label(objs, named or {})
    chain = [holder]
    for i in range(start, len(objs) - 1):
        parent, child = objs[i], objs[i + 1]
        step = edge(parent, child)
        if step == ".__dict__":
            continue
        if isinstance(parent, dict) and i > 0 and getattr(objs[i - 1], "__dict__", None) is parent:
            step = f".{next((k for k, v in parent.items() if v is child), '?')}"
        expr += step
        chain.append(f"{step.strip()} -> {short(child)}")
    return holder, _module_path(expr), chain


def _module_path(expr: str) -> str:
    """nn.Module internals read as attributes: ._modules['layers']._modules['0'] -> .layers[0]."""
    def attr(m):
        return f"[{m[1]}]" if m[1].isdigit() else f".{m[1]}"
    return re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", attr, expr)


def root_label(objs: list, named: dict[int, str]) -> tuple[str, str, int]:
    """(holder, start of the access path, index of the first object the path steps from)."""
    root, rest = objs[0], objs[1:] + [None, None, None]
    if id(root) in named:
        return named[id(root)], type(root).__name__, 0
    if isinstance(root, dict):  # a module's globals
        mod = next((n for n, m in list(sys.modules.items()) if getattr(m, "__dict__", None) is root), "?")
        key = next((k for k, v in root.items() if v is rest[0]), "?")
        return f"module global {mod}.{key}", f"{mod}.{key}", 1
    if isinstance(root, functools._lru_cache_wrapper):
        return _lru_label(root, objs)
    if isinstance(root, types.FunctionType):
        return _function_label(root, rest)
    if isinstance(root, type):
        key = next((k for k, v in vars(root).items() if v is rest[1]), None)
        name = f"{root.__module__}.{root.__qualname__}"
        return (f"class attribute {name}.{key}", f"{name}.{key}", 2) if key else (f"class {name}", name, 0)
    if isinstance(root, types.FrameType):
        where = f"{root.f_code.co_name} ({root.f_code.co_filename}:{root.f_lineno})"
        name = next((k for k, v in root.f_locals.items() if v is rest[0]), None)
        return (f"local variable {name} of {where}", name, 1) if name else (f"frame of {where}", "<frame>", 0)
    return f"{short(root)}", type(root).__name__, 0


def _lru_label(wrapper, objs: list) -> tuple[str, str, int]:
    """lru_cache roots: the cached function, and whether a key or a cached result holds the chain."""
    fn = f"{wrapper.__module__}.{wrapper.__qualname__}"
    cache = next((d for d in gc.get_referents(wrapper) if isinstance(d, dict) and d is not wrapper.__dict__), {})
    i = 1
    while i < len(objs) - 1 and (objs[i] is cache or type(objs[i]).__name__ == "_lru_list_elem"):
        i += 1  # the cache dict, a bounded cache's links
    role = "key" if any(k is objs[i] for k in cache) else "cached result"
    held = objs[i + 1] if isinstance(objs[i], tuple) and role == "key" and i + 1 < len(objs) else objs[i]
    if any(k is held or (isinstance(k, tuple) and any(x is held for x in k)) for k in cache):
        role = "key"  # a result that is also the key (or in it): the key is what keeps it
    return f"lru_cache {fn} ({role} holds {short(held)})", f"{fn}(<{role}>)", i


def _function_label(fn, rest: list) -> tuple[str, str, int]:
    name = f"{fn.__module__}.{fn.__qualname__}"
    if rest[0] is not None and rest[0] is fn.__closure__:
        var = fn.__code__.co_freevars[next(i for i, c in enumerate(fn.__closure__) if c is rest[1])]
        return f"closure of {name} (variable {var})", f"{name}.<{var}>", 3
    if rest[0] is not None and (rest[0] is fn.__defaults__ or rest[0] is fn.__kwdefaults__):
        return f"default argument of {name}", f"{name}.<defaults>", 1
    if rest[0] is not None and rest[0] is getattr(fn, "__dict__", None):
        key = next((k for k, v in fn.__dict__.items() if v is rest[1]), "?")
        return f"function attribute {name}.{key}", f"{name}.{key}", 2
    return f"function {name}", name, 0


def edge(parent, child) -> str:
    """How ``parent`` holds ``child``, as an access step."""
    if isinstance(parent, dict):
        for k, v in parent.items():
            if v is child:
                return f"[{k!r}]" if isinstance(k, (str, int)) else f"[{short(k)}]"
            if k is child:
                return f" key {short(k)}"
    if isinstance(parent, (list, tuple)):
        return next((f"[{i}]" for i, v in enumerate(parent) if v is child), "[?]")
    if isinstance(parent, types.CellType):
        return ".cell_contents"
    if isinstance(parent, types.MethodType):
        return ".__self__" if parent.__self__ is child else ".__func__"
    if getattr(parent, "__dict__", None) is child:
        return ".__dict__"
    names = list(getattr(parent, "__dict__", {}).items()) + [
        (s, getattr(parent, s, None)) for s in getattr(type(parent), "__slots__", ())]
    return next((f".{k}" for k, v in names if v is child), f" -> ({type(parent).__name__})")


def short(obj) -> str:
    """A few words for one object in a chain."""
    import torch

    if isinstance(obj, torch.Tensor):
        st = storage_key(obj)
        size = f", storage {st[2] / MiB:.3g} MiB" if st else ""
        return f"{type(obj).__name__}[{'x'.join(map(str, obj.shape))}] {str(obj.dtype).replace('torch.', '')} " \
               f"{obj.device}{size}"
    if isinstance(obj, types.MethodType):
        return f"bound method {obj.__func__.__qualname__} of <{type(obj.__self__).__name__}>"
    if isinstance(obj, (types.FunctionType, type)):
        return f"{obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, (list, tuple, dict, set)):
        return f"{type(obj).__name__} of {len(obj)}"
    return f"<{type(obj).__name__}>"
