"""The wake-cycle check's options (each default written once: the CLI, the config and the worker read
them from here) and its --help."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvdiag.checks import greedy
from kvdiag.checks.check import option

MAX_TOKENS = 24


@dataclass
class WakeParams:
    levels: list[int] = option([1], "--level", "-l", choices=(1, 2), help="Sleep level: 1 (weights offloaded to "
                               "CPU, KV discarded) or 2 (both discarded); repeat for both. Default: 1.")
    staged: bool = option(False, "--staged", help="Wake in two steps, 'weights' then 'kv_cache', instead of all tags "
                          "at once.")
    cycles: int = option(5, "--cycles", "-n", help="How many cycles to run.", min=1)
    max_tokens: int = option(MAX_TOKENS, "--max-tokens", help="Tokens generated greedily per prompt.", min=1)
    logprob_tol: float = option(greedy.LOGPROB_TOL, "--logprob-tol", min=0,
                                help="Largest |Δ logprob| allowed where the tokens are identical.")
    seed: int = option(0, "--seed", help="Random seed.")
    level: int = 1  # this case's level (one of levels)

    @classmethod
    def from_case(cls, case) -> "WakeParams":
        return cls(**{k: case.params[k] for k in asdict(cls()) if case.params.get(k) is not None})


def variants(p: WakeParams) -> list[dict]:
    """One case per dtype and sleep level: the level and its id suffix (``L2``, ``L2-staged``)."""
    from kvdiag.errors import UserError

    levels = list(dict.fromkeys(p.levels or [1]))
    if bad := [x for x in levels if x not in (1, 2)]:
        raise UserError(f"--level {bad[0]}: sleep levels are 1 and 2")
    return [{"level": lv, "staged": p.staged, "suffix": f"L{lv}" + ("-staged" if p.staged else "")} for lv in levels]


HELP = (
    "Sleep and wake the engine N times per kv dtype; outputs must stay identical.\n"
    "\n"
    "Records greedy tokens and logprobs of a fixed prompt set, then each cycle sleeps,\n"
    "checks that the KV cache (and at level 2, or on a GPU, the weights) was freed, wakes,\n"
    "checks that memory came back, regenerates and compares token for token, and scans the\n"
    "KV slots just written for NaN/Inf. Engines without sleep mode are reported as unsupported.")
