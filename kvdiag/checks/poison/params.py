"""The poison check's options (each default written once: the CLI, the config and the worker read
them from here) and its --help."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvdiag.checks import greedy
from kvdiag.checks.check import option


@dataclass
class PoisonParams:
    value: str = option("nan", "--value", choices=("nan", "inf", "max", "random"), help="What free blocks (K, V "
                        "and scale slots) are filled with: nan, inf (NaN where the dtype has no inf), max (the "
                        "dtype's largest finite value) or random (seeded random bits).")
    logprob_tol: float = option(greedy.LOGPROB_TOL, "--logprob-tol", min=0,
                                help="Largest |Δ logprob| allowed where the tokens are identical.")
    lengths: bool = option(False, "--lengths", help="A fourth wave: one prompt of every length mod the KV block "
                           "size, 0 to B-1 (B prompts of 2B to 3B-1 tokens), so that a prompt's last block is "
                           "written up to every slot before decode reads it.")
    seed: int = option(0, "--seed", help="Random seed.")

    @classmethod
    def from_case(cls, case) -> "PoisonParams":
        return cls(**{k: case.params[k] for k in asdict(cls()) if case.params.get(k) is not None})


HELP = (
    "Poison every free KV block, run a workload that allocates fresh blocks, compare with a clean run.\n"
    "\n"
    "Per kv dtype: three waves of requests (decodes growing across block boundaries, short\n"
    "requests on freed blocks, all at once) in a cache small enough that freed blocks are\n"
    "reused; free blocks are re-poisoned before each wave. The same waves with zeroed free\n"
    "blocks are the reference. Any NaN/Inf or changed token fails, naming the request and\n"
    "position that first differed. Engines without KV access are reported as unsupported.")
