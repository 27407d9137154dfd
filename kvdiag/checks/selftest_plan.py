"""What `kvdiag selftest` runs: every builtin fault, its bug class, the check meant to catch it, and
where else it runs; the checks, with the small sizes that keep the whole self-test within minutes.

Cells of the matrix (fault x check):

- ``caught``: the check ran with the fault switched on and reported an error finding.
- ``missed``: it ran and reported none (or only ran out of time).
- ``n/a``: the check cannot observe that fault by design (the reason is in ``na`` below: it never
  sleeps, never measures memory, only compares the engine with itself on one dtype, ...).
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

CHECKS = ("accuracy", "dtypes", "memleak", "wake-cycle", "poison")
# The sizes of a self-test case (case.params) are each check's ``Check.selftest`` (kvdiag.checks.registry).
BASELINE = "auto"  # accuracy and dtypes compare every dtype with the same engine's 'auto'
COMPARES_TO_BASELINE = ("accuracy", "dtypes")

L1, L2 = {"level": 1}, {"level": 2}


@dataclass(frozen=True)
class Item:
    """One case of a check: a kv dtype and the variant params (wake-cycle's sleep level)."""

    kv_dtype: str
    params: dict = field(default_factory=dict)

    @property
    def suffix(self) -> str | None:
        return f"L{self.params['level']}" if "level" in self.params else None

    @property
    def key(self) -> tuple:
        return (self.kv_dtype, tuple(sorted(self.params.items())))


def items(*specs) -> tuple[Item, ...]:
    """``items("auto", ("fp8", L2))``."""
    return tuple(Item(s) if isinstance(s, str) else Item(s[0], dict(s[1])) for s in specs)


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
FAULT_NAMES = tuple(f.name for f in FAULTS)


def fault(name: str) -> Fault:
    return next(f for f in FAULTS if f.name == name)


def cell_plan(f: Fault, check: str) -> str:
    """What the plan says for a cell: ``run``, ``n/a`` or ``-`` (could observe it, not run)."""
    return "run" if check in f.runs else "n/a" if check in f.na else "-"


def select(faults: list[str] | None, checks: list[str] | None) -> tuple[list[Fault], list[str]]:
    """The faults and checks to run (names validated: UserError with the valid names).

    ``checks`` alone keeps the faults whose intended check is selected; a named fault whose
    intended check is left out by ``checks`` is bad input (its verdict would mean nothing).
    """
    from kvdiag.errors import UserError

    checks_sel = _names(checks, CHECKS, "check") or list(CHECKS)
    names = _names(faults, FAULT_NAMES, "fault")
    if names:
        chosen = [fault(n) for n in names]
        for f in chosen:
            if f.intended not in checks_sel:
                raise UserError(f"--fault {f.name}: its intended check '{f.intended}' is not among --check "
                                f"{', '.join(checks_sel)}")
    else:
        chosen = [f for f in FAULTS if f.intended in checks_sel]
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
