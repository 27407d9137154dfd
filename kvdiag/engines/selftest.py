"""What a self-test fault of an engine is: each engine's `kvdiag selftest` catalogue is a :class:`Catalogue` of
:class:`Fault` s, declared in the engine's own folder (``kvdiag/engines/builtin/selftest.py``,
``kvdiag/engines/vllm/selftest.py``; a plug-in's ``EngineTraits.selftest()``) and found through its traits
(``kvdiag.engines.traits``). How the checks run and judge them is ``kvdiag/checks/selftest/``.

A fault names its bug class (docs/DESIGN.md, "Bug classes"), the check meant to catch it (``intended``), the cases
it runs in each check (:class:`Item` s: a kv dtype, variant params, a model), and what it must move (``moves``: one
or more of :data:`OBSERVATIONS`). It names no other check: each check says what it observes (``Check.observes``),
and a check the fault does not run in is ``n/a`` when it observes none of what the fault moves (why: :data:`BLIND`),
or when it observes something the fault says cannot show it (``unseen``: observation -> why); else ``-``: it could
observe the fault but is left out to keep the self-test short (:func:`not_observed`).

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


# What a check observes and a fault moves: memory after shutdown, sleep and wake (memory freed, outputs after), KV
# blocks nothing wrote, the paths a request's KV takes, scores against a baseline dtype, output tokens.
OBSERVATIONS = ("memory", "sleep", "kv_blocks", "kv_paths", "scores", "tokens")
OUTPUTS = ("scores", "tokens")

# Why a check cannot observe a fault by design: the words of a check that does not observe what the fault moves.
NEVER_SLEEPS = "never sleeps or wakes the engine"
NO_MEMORY = "does not measure memory"
SELF_COMPARE = "compares the engine only with itself, on one dtype"
MEMORY_ONLY = "looks at memory, not at outputs"
NO_POISON = "never puts non-finite data in free KV blocks (wake-cycle zeroes them), and 0 x finite = 0"
ONE_PATH = "runs every request by one path: one cold prefill, then decode"
BLIND = {"memory": NO_MEMORY, "sleep": NEVER_SLEEPS, "kv_blocks": NO_POISON, "kv_paths": ONE_PATH,
         "scores": SELF_COMPARE, "tokens": MEMORY_ONLY}  # a check that observes no output: MEMORY_ONLY


@dataclass(frozen=True)
class Fault:
    name: str  # what --fault takes (an engine's fault switch, or an alias of several)
    bug_class: str  # S0-S5 (docs/DESIGN.md, "Bug classes") or accuracy
    intended: str  # the check that must catch it
    runs: dict  # check -> items; the intended check first
    moves: tuple  # the observations it must move (OBSERVATIONS); empty: not said, no check is n/a by design
    what: str
    leaves_process_state: bool = False  # leaks into the worker: its cases get workers of their own
    kinds: dict = field(default_factory=dict)  # check -> the finding kinds that count as catching it (else any error)
    unseen: dict = field(default_factory=dict)  # observation -> why a check that observes it still cannot see this

    def __post_init__(self):
        odd = sorted(set(self.moves) - set(OBSERVATIONS)) + sorted(set(self.unseen) - set(OBSERVATIONS))
        if odd:
            raise ValueError(f"fault {self.name}: no observation {', '.join(odd)}; known: {', '.join(OBSERVATIONS)}")

    @property
    def also(self) -> tuple[str, ...]:
        return tuple(c for c in self.runs if c != self.intended)


def not_observed(f: Fault, observes: dict) -> dict:
    """check -> why it cannot observe fault ``f`` by design, for the checks ``f`` does not run in; ``observes``:
    check -> what it observes (``Check.observes``). The fault's own reason where the check observes something the
    fault names in ``unseen``; else, where the check observes none of what the fault moves, the first such
    observation's :data:`BLIND` reason (:data:`MEMORY_ONLY` for an output when the check observes no output)."""
    out = {}
    for check, seen in observes.items():
        if check in f.runs or not f.moves:
            continue
        own = next((f.unseen[o] for o in OBSERVATIONS if o in seen and o in f.unseen), None)
        if own is None and not set(seen) & set(f.moves):
            first = next(o for o in OBSERVATIONS if o in f.moves)
            own = MEMORY_ONLY if first in OUTPUTS and not set(seen) & set(OUTPUTS) else BLIND[first]
        if own is not None:
            out[check] = own
    return out


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
