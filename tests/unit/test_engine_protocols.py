"""The engine contract held as a test: every engine member a check reads is declared in
``kvdiag/engines/protocol.py`` (the ``Engine`` protocol, or an optional capability such as ``WorkerProcesses``), no
code outside ``kvdiag/engines/`` reads an engine with ``getattr``/``hasattr``, and each engine kvdiag ships, the toy
engine and the test fakes implement every protocol they declare (no member left to the protocol's empty stub) and
declare every capability they implement.

The reads are found in the source (``ast``): attributes of a name that holds an engine (``engine``, ``eng``,
``donor``, a name bound to ``create_engine(...)``/``start_engine(...)``/``acquire_engine(...)``/
``start_or_record(...)``, and ``self.engine`` in a class whose ``__init__`` takes an ``engine``).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from kvdiag.engines import protocol

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [p for p in sorted((ROOT / "kvdiag").iterdir()) if p.name != "engines"]  # all of kvdiag but the engines
ENGINE_NAMES = {"engine", "eng", "donor"}
ENGINE_MAKERS = {"create_engine", "start_engine", "acquire_engine", "start_or_record"}
CAPABILITIES = tuple(v for v in vars(protocol).values() if getattr(v, "_is_runtime_protocol", False)
                     and v is not protocol.Engine)  # every optional capability, a new one too
PROTOCOLS = (protocol.Engine, *CAPABILITIES)


def members(proto) -> set[str]:
    """What a protocol declares: its annotated data members, methods and properties."""
    return set(proto.__dict__.get("__annotations__", {})) | {n for n in proto.__dict__ if not n.startswith("_")}


DECLARED = set().union(*map(members, PROTOCOLS))


# ---------------------------------------------------------------- the reads, from the source


def _maker(call) -> bool:
    f = call.func if isinstance(call, ast.Call) else None
    return isinstance(f, (ast.Name, ast.Attribute)) and (f.id if isinstance(f, ast.Name) else f.attr) in ENGINE_MAKERS


def _bound_engines(scope) -> set[str]:
    """Names a function binds to what an engine maker returns (``x, failed = start_or_record(...)``: ``x``)."""
    out = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and _maker(node.value):
            for t in node.targets:
                first = t.elts[0] if isinstance(t, ast.Tuple) and t.elts else t
                if isinstance(first, ast.Name):
                    out.add(first.id)
    return out


def _engine_selves(tree) -> set[int]:
    """ids of the class nodes whose ``__init__`` takes an ``engine``: their ``self.engine`` is one."""
    return {id(c) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name == "__init__" and "engine" in {a.arg for a in f.args.args}}


def engine_reads(source: str, where: str = "<source>") -> tuple[list[str], list[str]]:
    """(undeclared member reads, getattr/hasattr calls on an engine), each as ``where:line name``."""
    tree = ast.parse(source)
    undeclared, reflective = [], []

    def is_engine(node, names, in_engine_class) -> bool:
        if isinstance(node, ast.Name):
            return node.id in names
        return (in_engine_class and isinstance(node, ast.Attribute) and node.attr == "engine"
                and isinstance(node.value, ast.Name) and node.value.id == "self")

    def visit(node, names, in_engine_class):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            names = names | _bound_engines(node)
        if isinstance(node, ast.ClassDef):
            in_engine_class = id(node) in selves
        if isinstance(node, ast.Attribute) and is_engine(node.value, names, in_engine_class):
            if node.attr not in DECLARED:
                undeclared.append(f"{where}:{node.lineno} {node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and is_engine(node.args[0], names, in_engine_class):
            reflective.append(f"{where}:{node.lineno} {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, names, in_engine_class)

    selves = _engine_selves(tree)
    visit(tree, ENGINE_NAMES | _bound_engines(tree), False)
    return undeclared, reflective


def _scan() -> tuple[list[str], list[str]]:
    undeclared, reflective = [], []
    for top in SCANNED:
        for path in sorted(top.rglob("*.py")) if top.is_dir() else [top] if top.suffix == ".py" else []:
            u, r = engine_reads(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
            undeclared += u
            reflective += r
    return undeclared, reflective


def test_every_engine_member_a_check_reads_is_declared_in_a_protocol():
    undeclared, _ = _scan()
    assert not undeclared, "engine members read but declared in no protocol of kvdiag/engines/protocol.py: " + \
        ", ".join(undeclared)


def test_no_check_reads_an_engine_with_getattr_or_hasattr():
    _, reflective = _scan()
    assert not reflective, "ask isinstance(engine, Capability) instead: " + ", ".join(reflective)


def test_the_scan_finds_an_undeclared_read_and_a_getattr_wherever_the_engine_is_held():
    source = '''
def f(case):
    engine = create_engine(case.engine)
    engine.generate([], 1)
    engine.secret_counter()
    return getattr(engine, "hidden", None)

def g(case):
    base, failed = start_or_record(case, None)
    return base.private_pool, hasattr(base, "x")

class Adapter:
    def __init__(self, engine):
        self.engine = engine

    def name(self):
        return self.engine.nickname

def plain(engine: str):
    return engine.startswith("vllm")
'''
    undeclared, reflective = engine_reads(source)
    assert [u.split(" ")[1] for u in undeclared] == ["secret_counter", "private_pool", "nickname", "startswith"]
    assert len(reflective) == 2 and "hidden" in reflective[0] and "hasattr(base" in reflective[1]


# ---------------------------------------------------------------- the engines implement what they declare


def declared(cls) -> list:
    """The protocols of kvdiag/engines/protocol.py that ``cls`` subclasses."""
    return [p for p in PROTOCOLS if p in cls.__mro__]


def unimplemented(engine) -> list[str]:
    """``Protocol.member`` for each member of a declared protocol that the engine leaves to the protocol's stub (or
    lacks: a data member neither its class nor the object sets)."""
    out = []
    for proto in declared(type(engine)):
        for name in sorted(members(proto)):
            owner = next((c for c in type(engine).__mro__ if name in c.__dict__), None)
            if owner is None and name not in vars(engine) or owner is not None and owner in PROTOCOLS:
                out.append(f"{proto.__name__}.{name}")
    return out


def undeclared_capabilities(engine) -> list[str]:
    """The optional capabilities whose every member the engine has without declaring it."""
    has = [p for p in CAPABILITIES if all(hasattr(engine, m) for m in members(p))]
    return [p.__name__ for p in has if p not in declared(type(engine))]


def _vllm_engine(monkeypatch):
    """VllmEngine, not started (its module imports neither vllm nor torch; without vLLM the fake stands for it)."""
    if importlib.util.find_spec("vllm") is None:
        monkeypatch.syspath_prepend(str(ROOT / "tests" / "support" / "fake_vllm"))
    from kvdiag.engines.vllm.engine import VllmEngine

    return VllmEngine()


def _builtin_engine(monkeypatch):
    from kvdiag.engines.builtin.engine import BuiltinEngine

    return BuiltinEngine()


def _toy_engine(monkeypatch):
    from toy_engine import ToyEngine

    return ToyEngine()


SHIPPED = {
    "builtin": (_builtin_engine, {"Engine", "ModelFacts", "EndOfText", "SharesWeights", "PathProbes",
                                  "Replayable"}),
    "vllm": (_vllm_engine, {"Engine", "ReportsFinished", "Replayable", "ModelFacts", "EndOfText",
                            "HoldsAfterShutdown", "WorkerProcesses", "LayerSpecs", "WeightBytes", "PathProbes",
                            "GraphMode", "CacheBlockSize"}),
    "toy": (_toy_engine, {"Engine"}),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_engine_implements_every_protocol_it_declares(name, monkeypatch):
    make, expected = SHIPPED[name]
    engine = make(monkeypatch)
    assert {p.__name__ for p in declared(type(engine))} == expected
    assert all(isinstance(engine, p) for p in declared(type(engine)))
    assert not unimplemented(engine), f"{name}: declared, left to the protocol's stub: {unimplemented(engine)}"
    assert not undeclared_capabilities(engine), f"{name} implements without declaring: " \
        f"{undeclared_capabilities(engine)}"


def test_the_test_engines_implement_what_they_declare():
    import limited_engines
    import memleak_fakes
    from cache_engines import CacheEngine

    engines = [memleak_fakes.LeakyEngine(), memleak_fakes.SleepPoolEngine(), memleak_fakes.KVKeeperEngine(),
               limited_engines.no_sleep(), limited_engines.kv_elsewhere(), limited_engines.picky(), CacheEngine()]
    for engine in engines:
        assert protocol.Engine in declared(type(engine)), type(engine).__name__
        assert not unimplemented(engine), f"{type(engine).__name__}: {unimplemented(engine)}"
        assert not undeclared_capabilities(engine), f"{type(engine).__name__}: {undeclared_capabilities(engine)}"


def test_an_engine_that_leaves_a_declared_member_to_the_stub_is_found():
    class Half(protocol.Engine, protocol.PathProbes):
        name = "half"

        def reset_prefix_cache(self) -> bool:
            return True

    missing = unimplemented(Half())
    assert "PathProbes.path_counters" in missing and "Engine.generate" in missing
    assert "PathProbes.reset_prefix_cache" not in missing and "Engine.name" not in missing

    class Quiet:  # has a capability's members, declares nothing
        def held_after_shutdown(self):
            return []

    assert undeclared_capabilities(Quiet()) == ["HoldsAfterShutdown"]
