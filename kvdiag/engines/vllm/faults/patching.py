"""How a vLLM fault patches its code point, and how it says that it fired.

A code point is a place in vLLM's source: a module and a name in it (``"GPUModelRunner.shutdown"``, or a
module-level name). :func:`missing_in_source` says, without importing vLLM (``kvdiag selftest --list`` and the
selftest's plan stay instant), whether the installed vLLM has it; :func:`resolve` finds it in the imported vLLM.
:func:`wrap` replaces it by a wrapper (once per fault: a second :func:`wrap` of the same fault is a no-op) and
:func:`restore` puts every original back. A wrapper calls :func:`fire` when the patched behaviour actually ran;
:func:`fired` is what the case record carries, so that a fault whose code is never reached is never counted as
caught.

Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import ast
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvdiag.case import FIRED_MARK


class NotApplicable(Exception):
    """The fault's code point does not exist in this vLLM (or the case cannot reach it); the message says why."""


@dataclass(frozen=True)
class CodePoint:
    module: str  # "vllm.v1.worker.gpu_model_runner"
    name: str  # "GPUModelRunner.shutdown", or a module-level name

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


_FIRED: dict[str, int] = {}
_NOT_APPLICABLE: dict[str, str] = {}  # fault -> why, found when it was applied in this process
_PATCHES: list[tuple[object, str, object, str]] = []  # (owner, attribute, original, fault), in patch order


def fire(fault: str) -> None:
    """The patched behaviour of ``fault`` ran (a counter per fault, for this process), also said in the case log
    (``FIRED_MARK``): a fault whose effect kills the worker is still known to have fired."""
    _FIRED[fault] = _FIRED.get(fault, 0) + 1
    print(f"{FIRED_MARK}{fault}", file=sys.stderr, flush=True)


def fired() -> dict[str, int]:
    """How often each fault's patched behaviour ran in this process."""
    return dict(_FIRED)


def not_applicable() -> dict[str, str]:
    """The faults found not applicable when applied in this process, with the reason."""
    return dict(_NOT_APPLICABLE)


def mark_not_applicable(fault: str, reason: str) -> None:
    _NOT_APPLICABLE[fault] = reason


def vllm_root() -> Path | None:
    """The installed vllm package's folder, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def missing_in_source(cp: CodePoint) -> str | None:
    """None when the installed vLLM's source defines ``cp`` (a class attribute or method, or a module-level name,
    imported names included); else why not, in one line. Reads the source: vLLM is not imported."""
    root = vllm_root()
    if root is None:
        return "vLLM is not installed"
    rel = Path(*cp.module.split(".")[1:])
    path = next((p for p in (root / rel.with_suffix(".py"), root / rel / "__init__.py") if p.is_file()), None)
    if path is None:
        return f"no module {cp.module} in this vLLM"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError) as e:
        return f"{cp.module} cannot be read ({type(e).__name__})"
    owner, _, attr = cp.name.rpartition(".")
    body = tree.body
    if owner:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            return f"no class {owner} in {cp.module}"
        body = cls.body
    if attr in _defined(body):
        return None
    return f"{cp.module} has no {cp.name}"


def _defined(body) -> set[str]:
    names = set()
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.ImportFrom):
            names |= {a.asname or a.name for a in n.names}
    return names


def resolve(cp: CodePoint) -> tuple[object, str]:
    """(owner, attribute) of ``cp`` in the imported vLLM; NotApplicable when the module cannot be imported here or
    lacks the name."""
    try:
        owner = importlib.import_module(cp.module)
    except Exception as e:  # noqa: BLE001 - absent, or not importable on this platform
        raise NotApplicable(f"{cp.module} cannot be imported here ({type(e).__name__}: {e})"[:300]) from e
    *path, attr = cp.name.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            raise NotApplicable(f"{cp.module} has no {'.'.join(path)}")
    if not hasattr(owner, attr):
        raise NotApplicable(f"{cp.module} has no {cp.name}")
    return owner, attr


def wrap(cp: CodePoint, fault: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``cp`` by ``make(original)``, once for ``fault`` (idempotent: memleak starts the engine every
    cycle). Methods are replaced on the class that defines them: subclasses that inherit them are patched too."""
    owner, attr = resolve(cp)
    if any(o is owner and a == attr and f == fault for o, a, _, f in _PATCHES):
        return
    original = owner.__dict__[attr] if isinstance(owner, type) and attr in owner.__dict__ else getattr(owner, attr)
    patched = make(original)
    patched.__wrapped__ = original  # inspect.unwrap, and a reader, find vLLM's own code
    setattr(owner, attr, patched)
    _PATCHES.append((owner, attr, original, fault))


def wrap_any(points: tuple[CodePoint, ...], fault: str, make: Callable[[Callable], Callable]) -> list[str]:
    """Wrap every one of ``points`` this vLLM has (a fix often touched the V1 and the V2 model runner alike); the
    names wrapped. NotApplicable, with each point's reason, when none exists."""
    done, why = [], []
    for cp in points:
        try:
            wrap(cp, fault, make)
            done.append(str(cp))
        except NotApplicable as e:
            why.append(str(e))
    if not done:
        raise NotApplicable("; ".join(why))
    return done


def restore() -> None:
    """Undo every patch, newest first, and forget what fired (a plain script that applied faults and wants vLLM back
    as it was)."""
    while _PATCHES:
        owner, attr, original, _ = _PATCHES.pop()
        setattr(owner, attr, original)
    _FIRED.clear()
    _NOT_APPLICABLE.clear()
