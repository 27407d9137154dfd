"""What `kvdiag selftest` runs: every builtin fault, its bug class, the check meant to catch it, and
where else it runs; the checks, with the small sizes that keep the whole self-test within minutes. Another
engine's faults are its own :class:`Catalogue` (``selftest_engines.py`` finds it: vLLM's is ``selftest_vllm.py``;
a plug-in engine's, its factory's ``SELFTEST``).

Cells of the matrix (fault x check):

- ``caught``: the check ran with the fault switched on, the fault fired (where the engine records it: its
  patched code ran) and the check reported an error finding (of the fault's ``kinds`` for that check, where the
  plan names them).
- ``missed``: it ran, the fault fired, and the check reported no such finding (or only ran out of time).
- ``did not fire``: the engine records firing and the fault's patched code never ran in the check's cases:
  whatever the check reported, nothing was shown (never ``caught``).
- ``n/a``: the check cannot observe that fault by design (the reason is in ``na`` below: it never
  sleeps, never measures memory, only compares the engine with itself on one dtype, ...), or the fault cannot
  apply to this engine (its code point is absent, the platform lacks what it needs: the whole row, with why).
- ``-``: not run: the check could observe the fault but is left out of the self-test to keep it
  short, or ``--check``/``--fault`` left it out.

Every fault always runs through its intended check; ``also`` are the other checks it runs through
(a second detector is welcome, but only the intended check decides the exit code). The clean engine
runs every (check, dtype, variant) that any selected fault runs, so each ``caught`` is a difference
from a clean run of the very same case.

No torch import here: ``kvdiag selftest --list`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

CHECKS = ("accuracy", "dtypes", "memleak", "wake-cycle", "poison")
# The sizes of a self-test case (case.params) are each check's ``Check.selftest`` (kvdiag.checks.registry).
BASELINE = "auto"  # accuracy and dtypes compare every dtype with the same engine's 'auto'
COMPARES_TO_BASELINE = ("accuracy", "dtypes")

L1, L2 = {"level": 1}, {"level": 2}


@dataclass(frozen=True)
class Item:
    """One case of a check: a kv dtype, the variant params (wake-cycle's sleep level) and the model (None: the
    shipped tiny model; a ``zoo:NAME`` for a fault that needs another architecture)."""

    kv_dtype: str
    params: dict = field(default_factory=dict)
    model: str | None = None

    @property
    def suffix(self) -> str | None:
        parts = [f"L{self.params['level']}" if "level" in self.params else None,
                 self.model.replace(":", "-") if self.model else None]
        return "/".join(p for p in parts if p) or None

    @property
    def key(self) -> tuple:
        return (self.kv_dtype, tuple(sorted(self.params.items())), self.model)


def items(*specs, model: str | None = None) -> tuple[Item, ...]:
    """``items("auto", ("fp8", L2))``; ``model``: for every item."""
    return tuple(Item(s, model=model) if isinstance(s, str) else Item(s[0], dict(s[1]), model) for s in specs)


NEVER_SLEEPS = "never sleeps or wakes the engine"
NO_MEMORY = "does not measure memory"
SELF_COMPARE = "compares the engine only with itself, on one dtype"
MEMORY_ONLY = "looks at memory, not at outputs"
NO_POISON = "never puts non-finite data in free KV blocks (wake-cycle zeroes them), and 0 x finite = 0"


@dataclass(frozen=True)
class Fault:
    name: str  # what --fault takes (a Faults switch, or an alias of several)
    bug_class: str  # S0-S4 (docs/DESIGN.md, "Bug classes") or accuracy
    intended: str  # the check that must catch it
    runs: dict  # check -> items; the intended check first
    na: dict  # check -> why it cannot observe the fault
    what: str
    leaves_process_state: bool = False  # leaks into the worker: its cases get workers of their own
    kinds: dict = field(default_factory=dict)  # check -> the finding kinds that count as catching it (else any error)

    @property
    def also(self) -> tuple[str, ...]:
        return tuple(c for c in self.runs if c != self.intended)


def _na(reason_by_check: dict, *checks: str) -> dict:
    return {c: reason_by_check.get(c, reason_by_check.get("*")) for c in checks}


FAULTS: tuple[Fault, ...] = (
    Fault("scale_cache_registry", "S0", "memleak", {"memleak": items("int8_per_token_head")},
          _na({"*": NO_MEMORY, "wake-cycle": "the scale caches are ~6% of an int8 cache: within wake-cycle's "
               "tolerance for memory freed while asleep"}, "accuracy", "dtypes", "wake-cycle", "poison"),
          "per-token-head scale caches kept in a module global after shutdown", leaves_process_state=True),
    Fault("explicit_bf16_rejected", "S1", "dtypes",
          {"dtypes": items("bfloat16"), "accuracy": items("bfloat16"), "memleak": items("bfloat16"),
           "wake-cycle": items(("bfloat16", L1)), "poison": items("bfloat16")},
          {}, "kv_cache_dtype='bfloat16' raises 'Unsupported data type of kv cache: bfloat16'"),
    Fault("explicit_bf16_misdispatch", "S1", "dtypes", {"dtypes": items("bfloat16"), "accuracy": items("bfloat16")},
          _na({"*": SELF_COMPARE, "memleak": MEMORY_ONLY}, "memleak", "wake-cycle", "poison"),
          "an explicit 'bfloat16' runs the fp8 path: not bit-identical to 'auto'"),
    Fault("stale_views_after_wake", "S2", "wake-cycle", {"wake-cycle": items(("auto", L1))},
          _na({"*": NEVER_SLEEPS}, "accuracy", "dtypes", "memleak", "poison"),
          "cache views and pointer/stride tables not rebuilt after wake"),
    Fault("fp8_scales_lost_on_wake", "S2", "wake-cycle", {"wake-cycle": items(("fp8", L2))},
          _na({"*": NEVER_SLEEPS}, "accuracy", "dtypes", "memleak", "poison"),
          "per-tensor fp8 k/v scales come back as 0.0 after a level-2 wake"),
    Fault("unzeroed_page_reads", "S3", "poison", {"poison": items("auto")},
          _na({"*": NO_POISON}, "accuracy", "dtypes", "memleak", "wake-cycle"),
          "fresh blocks not zeroed and attention reads whole pages (whole_page_reads + no_zero_fresh_blocks)"),
    Fault("lru_cache_bound_method", "S4", "memleak",
          {"memleak": items("int8_per_token_head"), "wake-cycle": items(("auto", L2))},
          _na({"*": NO_MEMORY}, "accuracy", "dtypes", "poison"),
          "an lru_cache keyed by the model's bound forward keeps the weights alive", leaves_process_state=True),
    Fault("gc_freeze_not_undone", "S4", "memleak", {"memleak": items("int8_per_token_head")},
          _na({"*": NO_MEMORY, "wake-cycle": "frozen objects are still freed by reference counting; only "
               "gc.get_freeze_count() after shutdown shows the bug"}, "accuracy", "dtypes", "wake-cycle", "poison"),
          "gc.freeze() at start, never undone", leaves_process_state=True),
    Fault("global_kv_list", "S4", "memleak",
          {"memleak": items("int8_per_token_head"), "wake-cycle": items(("auto", L1))},
          _na({"*": NO_MEMORY}, "accuracy", "dtypes", "poison"),
          "the KV tensors appended to a module global on every start", leaves_process_state=True),
    Fault("orphan_worker_process", "S4", "memleak", {"memleak": items("auto")},
          _na({"*": NO_MEMORY, "wake-cycle": "the worker holds its memory whether the engine sleeps or not: sleep "
               "still frees the engine's own"}, "accuracy", "dtypes", "wake-cycle", "poison"),
          "every start launches a worker process that shutdown never stops", leaves_process_state=True),
    Fault("v_with_k_scales", "accuracy", "accuracy",
          {"accuracy": items("int8_per_token_head"), "dtypes": items("int8_per_token_head")},
          _na({"*": SELF_COMPARE, "memleak": MEMORY_ONLY}, "memleak", "wake-cycle", "poison"),
          "attention dequantizes V with K's scales (per-token-head dtypes; fp8 when k/v scales differ)"),
)


def fault(name: str) -> Fault:
    return next(f for f in FAULTS if f.name == name)


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

    def not_applicable(self, name: str) -> str | None:
        return self.applicability(name) if self.applicability is not None else None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.faults)

    def fault(self, name: str) -> Fault:
        return next(f for f in self.faults if f.name == name)


BUILTIN = Catalogue("builtin", FAULTS)


def select(faults: list[str] | None, checks: list[str] | None,
           cat: Catalogue = BUILTIN) -> tuple[list[Fault], list[str]]:
    """The faults and checks to run (names validated: UserError with the valid names).

    ``checks`` alone keeps the faults whose intended check is selected; a named fault whose
    intended check is left out by ``checks`` is bad input (its verdict would mean nothing).
    """
    from kvdiag.errors import UserError

    checks_sel = _names(checks, CHECKS, "check") or list(CHECKS)
    names = _names(faults, cat.names, "fault")
    if names:
        chosen = [cat.fault(n) for n in names]
        for f in chosen:
            if f.intended not in checks_sel:
                raise UserError(f"--fault {f.name}: its intended check '{f.intended}' is not among --check "
                                f"{', '.join(checks_sel)}")
    else:
        chosen = [f for f in cat.faults if f.intended in checks_sel]
    return chosen, [c for c in CHECKS if c in checks_sel]


def _names(given: list[str] | None, valid: tuple[str, ...], what: str) -> list[str]:
    from kvdiag.errors import UserError

    out = []
    for g in given or ():
        for part in g.split(","):
            n = part.strip().lower().replace("_" if what == "check" else "-", "-" if what == "check" else "_")
            if not n:
                continue
            if n not in valid:
                raise UserError(f"unknown {what} '{part.strip()}'; valid: {', '.join(valid)}")
            if n not in out:
                out.append(n)
    return out
