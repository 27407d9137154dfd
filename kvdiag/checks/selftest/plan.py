"""What `kvdiag selftest` runs: the checks, and which of an engine's faults and checks a command selects. Each
engine's faults are its own catalogue (``kvdiag.engines.selftest.Catalogue``, in the engine's folder:
``kvdiag/engines/builtin/selftest.py``, ``kvdiag/engines/vllm/selftest.py``; ``engines.py`` here asks the engine's
traits for it); the small sizes that keep the whole self-test within minutes are each check's ``Check.selftest``.

Cells of the matrix (fault x check):

- ``caught``: the check ran with the fault switched on, the fault fired (where the engine records it: its
  patched code ran) and the check reported an error finding (of the fault's ``kinds`` for that check, where the
  plan names them).
- ``missed``: it ran, the fault fired, and the check reported no such finding (or only ran out of time).
- ``did not fire``: the engine records firing and the fault's patched code never ran in the check's cases:
  whatever the check reported, nothing was shown (never ``caught``).
- ``n/a``: the check cannot observe that fault by design (:func:`na_of`: it observes none of what the fault moves:
  it never sleeps, never measures memory, only compares the engine with itself on one dtype, ...), or the fault cannot
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

from kvdiag.checks.registry import BUILTIN
from kvdiag.engines.selftest import Catalogue, Fault, not_observed

# kvdiag's own checks with self-test sizes (``Check.selftest``: a case's params), in the registry's order
CHECKS = tuple(c.name for c in BUILTIN if c.selftest is not None)
BASELINE = "auto"  # accuracy and dtypes compare every dtype with the same engine's 'auto'
COMPARES_TO_BASELINE = ("accuracy", "dtypes")


def select(faults: list[str] | None, checks: list[str] | None,
           cat: Catalogue | None = None) -> tuple[list[Fault], list[str]]:
    """The faults of ``cat`` (None: the builtin engine's) and the checks to run (names validated: UserError with the
    valid names).

    ``checks`` alone keeps the faults whose intended check is selected; a named fault whose
    intended check is left out by ``checks`` is bad input (its verdict would mean nothing).
    """
    from kvdiag.checks.selftest.engines import catalogue
    from kvdiag.errors import UserError

    cat = cat or catalogue("builtin")
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


def na_of(f: Fault) -> dict:
    """check -> why it cannot observe fault ``f`` by design: the checks that observe none of what ``f`` moves, or
    what ``f`` says they cannot see (``kvdiag.engines.selftest.not_observed``)."""
    return not_observed(f, {c.name: c.observes for c in BUILTIN if c.name in CHECKS})


def cell_plan(f: Fault, check: str) -> str:
    """What the plan says for a cell: ``run``, ``n/a`` or ``-`` (could observe it, not run)."""
    return "run" if check in f.runs else "n/a" if check in na_of(f) else "-"


def not_applicable(f: Fault, cat: Catalogue) -> str | None:
    """Why fault ``f`` is not run here: the engine's reason (its code point, the platform), and a path of its plan
    that this kvdiag's paths check does not have (a fault written ahead of its path)."""
    from kvdiag.checks.paths.catalogue import PATHS

    missing = [it.params["path"] for it in f.runs.get("paths", ()) if it.params.get("path") not in PATHS]
    why = (cat.not_applicable(f.name), f"kvdiag's paths check has no path {', '.join(missing)} here" if missing
           else None)
    return "; and ".join(r for r in why if r) or None


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
