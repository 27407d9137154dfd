from dataclasses import dataclass

from kvdiag.checks.registry import option


@dataclass
class ToyParams:
    rounds: int = option(2, "--rounds", help="How many rounds the toy counts.", min=1)
    mood: str = option("calm", "--mood", choices=("calm", "loud"), help="How it counts.")
