"""The installed vLLM's source, read without importing vllm (an import costs ~10 s before any worker starts): what
kvdiag asks of it before an engine exists (its cache dtypes and ``-a`` keys: adapt.py; its model's layer table:
compat.py)."""

from __future__ import annotations


def vllm_source(*parts: str):
    """The ast of a module of the installed vLLM (``vllm_source("config", "cache.py")``), read without importing
    vllm; None when vLLM or the file is missing or does not parse."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return ast.parse(Path(list(spec.submodule_search_locations)[0], *parts).read_text())
    except (OSError, SyntaxError, ValueError):
        return None


def top_assign(tree, name: str):
    """The value (an ast node) of the first module-level ``name = ...`` in a module's ast; None when there is none
    (or no tree)."""
    import ast

    return next((n.value for n in (tree.body if tree is not None else ()) if isinstance(n, ast.Assign)
                 and [getattr(t, "id", None) for t in n.targets] == [name]), None)
