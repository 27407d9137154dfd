"""What a self-test fault of an engine is: each engine's `kvdiag selftest` catalogue is a :class:`Catalogue` of
:class:`Fault` s, declared in the engine's own folder (``kvdiag/engines/builtin/selftest.py``,
``kvdiag/engines/vllm/selftest.py``; a plug-in's ``EngineTraits.selftest()``) and found through its traits
(``kvdiag.engines.traits``). How the checks run and judge them is ``kvdiag/checks/selftest/``.

A fault names its bug class (docs/DESIGN.md, "Bug classes"), the check meant to catch it (``intended``), the cases
it runs in each check (:class:`Item` s: a kv dtype, variant params, a model), and why each other check cannot
observe it by design (``na``: one of the reasons below, or the fault's own). A check named in neither is ``-``:
it could observe the fault but is left out to keep the self-test short.

No torch import here: ``kvdiag selftest --list`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

L1, L2 = {"level": 1}, {"level": 2}  # wake-cycle's sleep levels, as an Item's params


@dataclass(frozen=True)
class Item:
    """One case of a check: a kv dtype, the variant params (wake-cycle's sleep level, paths' path) and the model
    (None: the shipped tiny model; a ``zoo:NAME`` for a fault that needs another architecture)."""

    kv_dtype: str
    params: dict = field(default_factory=dict)
    model: str | None = None

    @property
    def suffix(self) -> str | None:
        parts = [f"L{self.params['level']}" if "level" in self.params else None, self.params.get("path"),
                 self.model.replace(":", "-") if self.model else None]
        return "/".join(p for p in parts if p) or None

    @property
    def key(self) -> tuple:
        return (self.kv_dtype, tuple(sorted(self.params.items())), self.model)


def items(*specs, model: str | None = None) -> tuple[Item, ...]:
    """``items("auto", ("fp8", L2))``; ``model``: for every item."""
    return tuple(Item(s, model=model) if isinstance(s, str) else Item(s[0], dict(s[1]), model) for s in specs)


# Why a check cannot observe a fault by design (a Fault's ``na``).
NEVER_SLEEPS = "never sleeps or wakes the engine"
NO_MEMORY = "does not measure memory"
SELF_COMPARE = "compares the engine only with itself, on one dtype"
MEMORY_ONLY = "looks at memory, not at outputs"
NO_POISON = "never puts non-finite data in free KV blocks (wake-cycle zeroes them), and 0 x finite = 0"
ONE_PATH = "runs every request by one path: one cold prefill, then decode"


@dataclass(frozen=True)
class Fault:
    name: str  # what --fault takes (an engine's fault switch, or an alias of several)
    bug_class: str  # S0-S5 (docs/DESIGN.md, "Bug classes") or accuracy
    intended: str  # the check that must catch it
    runs: dict  # check -> items; the intended check first
    na: dict  # check -> why it cannot observe the fault
    what: str
    leaves_process_state: bool = False  # leaks into the worker: its cases get workers of their own
    kinds: dict = field(default_factory=dict)  # check -> the finding kinds that count as catching it (else any error)

    @property
    def also(self) -> tuple[str, ...]:
        return tuple(c for c in self.runs if c != self.intended)


def na_for(reason_by_check: dict, *checks: str) -> dict:
    """A Fault's ``na`` for ``checks``: each check's reason in ``reason_by_check``, else its ``"*"`` reason."""
    return {c: reason_by_check.get(c, reason_by_check.get("*")) for c in checks}


def cell_plan(f: Fault, check: str) -> str:
    """What the plan says for a cell: ``run``, ``n/a`` or ``-`` (could observe it, not run)."""
    return "run" if check in f.runs else "n/a" if check in f.na else "-"


@dataclass(frozen=True)
class Catalogue:
    """One engine's self-test: its faults, the sizes its cases need beside each check's ``Check.selftest`` (vLLM
    has no 16-block cache), why a fault cannot apply here (None: it can), the engine arguments of every case (vLLM:
    eager) and what the output says of how the cases run (``note``)."""

    engine: str
    faults: tuple[Fault, ...]
    sizes: dict = field(default_factory=dict)  # check -> params over Check.selftest (None: the engine's default)
    applicability: Callable[[str], str | None] | None = None  # fault name -> why it cannot apply here, or None
    engine_args: dict = field(default_factory=dict)  # every case's --engine-arg
    note: str = ""  # shown under the matrix and in the reports
    forked: bool = True  # workers fork from the run's server (scheduling.fork_server); False: spawned (builtin)

    def not_applicable(self, name: str) -> str | None:
        return self.applicability(name) if self.applicability is not None else None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.faults)

    def fault(self, name: str) -> Fault:
        return next(f for f in self.faults if f.name == name)
