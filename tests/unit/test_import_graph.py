"""The import graph of kvdiag/, read from the source: no module imports itself back
through others (no cycle) and none imports from a higher layer than its own (docs/DESIGN.md, "Layers").

Module-level and function-level imports count (a function-level import is still a dependency, only a later one);
imports under ``if TYPE_CHECKING:`` do not (they never run). A string that names a module of the package
(``"kvdiag.checks.selftest.case:run"``: the self-test's case function; an engine's factory; a fork server's
preload list) is an edge too: it is imported later, by importlib, but it is a dependency all the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> folder: kvdiag.kernels' source is the top-level kernels/ (setup.py maps it)
SOURCES = {"kvdiag": ROOT / "kvdiag", "kvdiag.kernels": ROOT / "kernels"}

# Lowest first; a module may import from its own layer and those below. The same order is in docs/DESIGN.md.
LAYERS = [
    ("foundation", ["kvdiag.version", "kvdiag.errors", "kvdiag.dtypes", "kvdiag.results", "kvdiag.models",
                    "kvdiag.assets", "kvdiag.case", "kvdiag.gpus", "kvdiag.keyvalue", "kvdiag.death"]),
    ("kernels", ["kvdiag.kernels"]),
    ("engines", ["kvdiag.engines"]),
    ("measuring and evaluation", ["kvdiag.measure", "kvdiag.bench", "kvdiag.tasks"]),
    ("tables and charts", ["kvdiag.render"]),
    ("reproducers", ["kvdiag.proof"]),
    ("checks", ["kvdiag.checks"]),
    ("report", ["kvdiag.report"]),
    ("running cases", ["kvdiag.run", "kvdiag.ci"]),
    ("library", ["kvdiag", "kvdiag.api"]),  # kvdiag.run_check: what the commands wrap
    ("cli", ["kvdiag.cli", "kvdiag.__main__"]),
]
ORDER = " < ".join(name for name, _ in LAYERS)


def find_modules(sources: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join([package, *(parts[:-1] if is_pkg else parts)])] = (path, is_pkg)
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(node):
    """Every import statement under ``node``, at any depth, except in the body of ``if TYPE_CHECKING:``."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    if isinstance(node, ast.If) and _type_checking(node):
        for child in node.orelse:
            yield from _imports(child)
        return
    for child in ast.iter_child_nodes(node):
        yield from _imports(child)


REFERENCE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")  # "pkg.mod" or "pkg.mod:attr"


def _references(tree, packages) -> list[tuple[str, int]]:
    """(module, line) of every string constant that names a module path of ``packages``, as importlib takes it."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and REFERENCE.fullmatch(node.value):
            module = node.value.partition(":")[0]
            if module.split(".")[0] in packages:
                out.append((module, node.lineno))
    return out


def import_graph(sources: dict[str, Path]) -> tuple[dict[str, dict[str, str]], dict[str, tuple[Path, bool]]]:
    """importer -> {imported module: "file:line" of the first such import}, between the modules of ``sources``
    (``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``)."""
    modules = find_modules(sources)
    graph: dict[str, dict[str, str]] = {m: {} for m in modules}
    for name, (path, is_pkg) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for target, line in _references(tree, sources):  # a module named whole ("kvdiag.toml" is a file)
            if target in modules and target != name:
                graph[name].setdefault(target, f"{where}:{line} (a string)")
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    graph[name].setdefault(target, f"{where}:{node.lineno}")
    return graph, modules


def cycles(graph: dict[str, dict[str, str]], limit: int = 50) -> list[list[str]]:
    """The elementary cycles (each once, from its smallest module), at most ``limit``."""
    found = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack and len(found) < limit:
            node, path = stack.pop()
            for nxt in sorted(graph[node], reverse=True):
                if nxt == start:
                    found.append(path + [start])
                elif nxt > start and nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return found


def layer_of(module: str) -> int | None:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            inside = module == p or (p != "kvdiag" and module.startswith(p + "."))  # "kvdiag": only itself
            if inside and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def upward_imports(graph) -> list[tuple[str, str, str]]:
    return [(a, b, where) for a, targets in sorted(graph.items()) for b, where in sorted(targets.items())
            if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]


@pytest.fixture(scope="module")
def graph():
    return import_graph(SOURCES)[0]


def _cycle_text(graph, cycle) -> str:
    return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_graph_counts_function_level_relative_and_string_imports_but_not_type_checking_ones(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('TARGET = "pkg.a:f"  # a registry entry\nNOTE = "see pkg.c for why"\n')
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                              "else:\n    import pkg.sub\n\ndef f():\n    from pkg.sub.b import X\n")
    (pkg / "sub" / "b.py").write_text("from ..c import Y\n")
    (pkg / "c.py").write_text("import os\n\nclass K:\n    def m(self):\n        from pkg import a\n")
    g = {a: set(b) for a, b in import_graph({"pkg": pkg})[0].items()}
    assert g == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub", "pkg.sub.b"}, "pkg.sub": {"pkg.sub.b"},
                 "pkg.sub.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    found = cycles({a: dict.fromkeys(b, "") for a, b in g.items()})
    assert sorted(found) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.c", "pkg.a"],
                             ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_the_graph_sees_kvdiags_imports(graph):
    assert len(graph) > 80 and sum(map(len, graph.values())) > 200
    assert "kvdiag.kernels.dispatch" in graph["kvdiag.engines.builtin.engine"]
    assert "kvdiag.checks.registry" in graph["kvdiag.cli.app"]  # a function-level import
    assert "kvdiag.checks.poison.run" in graph["kvdiag.checks.poison"]  # a method of its class imports it


def test_every_module_has_a_layer(graph):
    missing = sorted(m for m in graph if layer_of(m) is None)
    assert not missing, f"add these modules to LAYERS here and to docs/DESIGN.md's Layers: {missing}"


def test_the_layers_are_those_of_docs_design():
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    assert f"Layers, lowest first: {ORDER}" in " ".join(text.split()), ORDER


def test_no_import_cycle(graph):
    found = cycles(graph)
    text = "\n".join(f"cycle {i + 1}: {_cycle_text(graph, c)}" for i, c in enumerate(found))
    print(text)
    assert not found, f"{len(found)} import cycle(s):\n{text}"


def test_no_import_of_a_higher_layer(graph):
    up = upward_imports(graph)
    text = "\n".join(f"{a} [{LAYERS[layer_of(a)][0]}] imports {b} [{LAYERS[layer_of(b)][0]}] at {where}"
                     for a, b, where in up)
    print(text)
    assert not up, f"{len(up)} import(s) of a higher layer (layers, lowest first: {ORDER}):\n{text}"


def test_kvdiag_kernels_is_the_top_level_kernels_folder_in_the_checkout():
    """The design's layout: the kernels' source is kernels/ beside kvdiag/, imported as kvdiag.kernels (the wheel
    carries it: tests/integration/test_wheel.py), and no folder or link named kernels is left inside kvdiag/."""
    import kvdiag.kernels.store

    assert Path(kvdiag.kernels.store.__file__).resolve() == ROOT / "kernels" / "store.py"
    assert not (ROOT / "kvdiag" / "kernels").exists() and not (ROOT / "kvdiag" / "kernels").is_symlink()
