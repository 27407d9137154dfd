"""How far one greedy run is from the cold run, and whether that is more than the engine's own noise.

vLLM is not batch-invariant: two cold runs, or the same prompts in another batch, may differ in the last bits of a
logprob, and a greedy token may flip where the cold run's top two candidates were nearly tied. So each path is held
to a floor measured on the same engine (two cold runs, the batch reordered, the outputs' halves recomputed), and for a
path run in an engine of its own, on that engine too:

- a logprob difference (over the positions before a request's first divergence) beyond
  ``max(logprob_tol, floor_factor * floor)`` fails;
- a changed greedy token fails unless the cold run's top two at that position were within that tolerance of each
  other (a near-tie: the floor's noise could flip it too), so a changed token weighs more than a logprob shift.

Pure: no torch, no engine; ``tests/unit/test_paths_floor.py`` holds it to hand-made runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvdiag.checks import greedy


@dataclass
class Divergence:
    request: int
    position: int
    expected: int | None
    got: int | None
    margin: float | None  # the cold run's top-1 minus top-2 logprob there (None: not known)


MOVE_STEPS = (1e-4, 1e-2, 0.1)  # |Δ logprob| past which a position's move is counted (Distance.moved_by)
# a comparison judged by the share of positions that moved past MOVED_BY: the share noise may move. Noise moves
# few positions by a little, or by a whole step of a bf16 logit (1/16 to 1/4); a fault many (docs/DESIGN.md)
MOVED_BY, MOVED_SHARE = 1e-2, 0.03


@dataclass
class Distance:
    """One run against the cold run."""

    requests: int = 0
    tokens: int = 0
    max_dlogprob: float = 0.0
    nonfinite: int = 0
    divergences: list[Divergence] = field(default_factory=list)  # each diverging request's first divergence
    compared: int = 0  # positions before each request's first divergence
    moved_by: dict = field(default_factory=dict)  # of them, how many moved more than each of MOVE_STEPS

    @property
    def moved(self) -> int:
        return self.moved_by.get(str(MOVED_BY), 0)

    @property
    def moved_share(self) -> float:
        return self.moved / self.compared if self.compared else 0.0

    def hard(self, tol: float) -> list[Divergence]:
        """The divergences that are not near-ties at ``tol``."""
        return [d for d in self.divergences if d.margin is None or d.margin > tol]

    def metrics(self, tol: float) -> dict:
        first = self.divergences[0] if self.divergences else None
        hard = self.hard(tol)
        return {"requests": self.requests, "tokens": self.tokens, "max_dlogprob": self.max_dlogprob,
                "diverged_requests": len(self.divergences), "hard_divergences": len(hard),
                "diverged_share": len(self.divergences) / self.requests if self.requests else 0.0,
                "nonfinite_logprobs": self.nonfinite, "positions": self.compared, "moved_by": self.moved_by,
                "first_difference": vars(hard[0] if hard else first) if first else None}


def distance(cold, run) -> Distance:
    """``run``'s completions against ``cold``'s (the same prompts, in the same order)."""
    g = greedy.compare(cold, run)
    d = Distance(requests=g.requests, tokens=g.tokens, max_dlogprob=g.max_dlogprob, nonfinite=g.nonfinite)
    moves = []
    for r, (a, b) in enumerate(zip(cold, run)):
        pos = greedy.first_divergence(a.token_ids, b.token_ids)
        if pos is not None:
            d.divergences.append(Divergence(r, pos, _at(a.token_ids, pos), _at(b.token_ids, pos), margin(a, pos)))
        moves += [abs(x - y) for x, y in zip(a.logprobs[:pos], b.logprobs[:pos])]
    d.compared = len(moves)
    d.moved_by = {str(step): sum(not m <= step for m in moves) for step in MOVE_STEPS}  # NaN: moved
    return d


def margin(completion, pos: int) -> float | None:
    """The gap between the best and second-best logprob at generated position ``pos`` (needs top-2 logprobs)."""
    tops = completion.top_logprobs
    if not tops or pos >= len(tops) or len(tops[pos]) < 2:
        return None
    best = sorted(tops[pos].values(), reverse=True)
    return float(best[0] - best[1])


def _at(ids, i):
    return ids[i] if i < len(ids) else None


@dataclass
class Floor:
    """The engine's own run-to-run difference: the largest of its floor runs against the cold run."""

    max_dlogprob: float = 0.0
    diverged: int = 0  # requests that diverged in some floor run
    runs: int = 0
    parts: dict = field(default_factory=dict)  # the largest |Δ logprob| of each kind of floor run: which set it
    moved_share: float = 0.0  # the largest share of positions a floor run moved (Distance.moved_share)

    def add(self, d: Distance, name: str = "floor run") -> None:
        dl = d.max_dlogprob if math.isfinite(d.max_dlogprob) else math.inf
        self.max_dlogprob = max(self.max_dlogprob, dl)
        self.diverged = max(self.diverged, len(d.divergences))
        self.moved_share = max(self.moved_share, d.moved_share)
        self.runs += 1
        self.parts[name] = max(self.parts.get(name, 0.0), dl)

    def merge(self, other: "Floor") -> None:
        self.max_dlogprob = max(self.max_dlogprob, other.max_dlogprob)
        self.diverged = max(self.diverged, other.diverged)
        self.moved_share = max(self.moved_share, other.moved_share)
        self.runs += other.runs
        for name, dl in other.parts.items():
            self.parts[name] = max(self.parts.get(name, 0.0), dl)

    def tolerance(self, logprob_tol: float, factor: float) -> float:
        return max(logprob_tol, factor * self.max_dlogprob)

    def setter(self) -> str:
        """The kind of floor run whose difference is the floor ("" where none differed or the parts are not known)."""
        return max(self.parts, key=self.parts.get) if self.parts and self.max_dlogprob else ""

    def set_by(self) -> str:
        return f", set by the {by}" if (by := self.setter()) else ""


def zero_floor(floor: Floor) -> tuple[Floor, str | None]:
    """Under batch invariance (``--batch-invariant``) the engine's own runs must agree exactly, so any difference
    is the path's: the floor a path is held to (0, with no tolerance above it: ``judge(d, Floor(), 0, 1)``), and,
    where the measured floor is not 0, what says so."""
    said = None
    if floor.max_dlogprob or floor.diverged:
        said = (f"under batch invariance the floor is {floor.max_dlogprob:.3g}, not 0{floor.set_by()}"
                f"{f', {floor.diverged} requests diverged' if floor.diverged else ''}: the engine's own runs differ "
                f"where batch invariance does not reach")
    return Floor(runs=floor.runs), said


def allowed_share(floor_share: float, factor: float) -> float:
    """The share of positions a comparison judged by its share (``judge``'s ``share_of``) may move."""
    return max(MOVED_SHARE, factor * floor_share)


def judge(d: Distance, floor: Floor, logprob_tol: float, factor: float,
          share_of: Floor | None = None) -> list[tuple[str, str, str]]:
    """(severity, code, message) of a path's distance from the cold run, held to the floor. ``share_of``: judge the
    logprobs by the share of positions that moved, against that floor's share (x ``factor``, at least
    MOVED_SHARE), not by the largest move: for two runs whose noise is a rare whole step (``floor`` still sets
    the tolerance of a near-tie)."""
    tol = floor.tolerance(logprob_tol, factor)
    out = []
    hard = d.hard(tol)
    if hard:
        f = hard[0]
        gap = "unknown" if f.margin is None else f"{f.margin:.3g}"
        out.append(("error", "divergence", f"request {f.request} first differs at generated position {f.position}: "
                    f"{f.got} instead of {f.expected} (the cold run's top two were {gap} apart, tolerance "
                    f"{tol:.3g}); {len(d.divergences)}/{d.requests} requests differ"))
    elif d.divergences:
        out.append(("info", "near_tie", f"{len(d.divergences)}/{d.requests} requests differ, each first where the "
                    f"cold run's top two were within {tol:.3g} (noise the floor allows)"))
    if share_of is not None:
        allowed = allowed_share(share_of.moved_share, factor)
        if d.moved_share > allowed:
            out.append(("error", "logprob_drift", f"{d.moved}/{d.compared} positions moved (|Δ logprob| > "
                        f"{MOVED_BY:g}, at most {d.max_dlogprob:.3g}) before any divergence: a share of "
                        f"{d.moved_share:.3g} > {allowed:.3g} (floor {share_of.moved_share:.3g}, x {factor:g}, at "
                        f"least {MOVED_SHARE:g})"))
    elif not math.isfinite(d.max_dlogprob) or d.max_dlogprob > tol:
        out.append(("error", "logprob_drift", f"max |Δ logprob| {d.max_dlogprob:.3g} before any divergence > "
                    f"{tol:.3g} (floor {floor.max_dlogprob:.3g}{floor.set_by()}, x {factor:g}, "
                    f"at least {logprob_tol:g})"))
    if d.nonfinite:
        out.append(("error", "nan_output", f"{d.nonfinite} non-finite logprobs"))
    return out
