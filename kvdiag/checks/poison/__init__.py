"""``poison``: does the engine ever read a KV block that nothing wrote (bug class S3)?

Before each wave of a workload every free block (K, V and scale slots) is filled with
poison (NaN, Inf, the dtype's max, or seeded random bits); the waves allocate fresh
blocks: new requests, decodes that grow across block boundaries, and a cache sized so
that blocks freed by one wave are reused by the next. The same waves run first with the
free blocks zeroed (the reference). Any NaN/Inf logprob, NaN written into the cache, or
token that differs from the reference fails, naming the request and position.

Sizing: the cache holds the largest wave plus one block (vLLM keeps block 0 as its null
block), ``max_model_len`` is what those blocks hold (vLLM refuses to start when one request
of ``max_model_len`` tokens would not fit), and prefix caching is off: with it, the poisoned
run would find the reference run's prompts cached and write no fresh block, and blocks that
keep a prefix hash are not free to poison. ``fresh_blocks`` counts the poisoned blocks the
workload was handed out and wrote; none is a warning (nothing was tested).

Hybrid models (attention + Mamba): a free block is poisoned in every group, the attention layers' K/V and the
state layers' conv/SSM states of that block id alike (``poisoned`` in the record names them); a block the workload
gave a state group is scanned as states (``fresh_state_blocks``, ``kv_state_nonfinite``), the others as K/V.

Files: ``params.py`` (its options), ``run.py`` (the worker), ``view.py`` (the terminal table).
"""

from __future__ import annotations

from kvdiag.checks.check import Check
from kvdiag.checks.poison.params import HELP, PoisonParams


class Poison(Check):
    name, params, help = "poison", PoisonParams, HELP
    gpu_share = True
    observes = frozenset({"kv_blocks", "tokens"})
    selftest = {"value": "nan", "num_prompts": 2, "seed": 0}

    def run(self, case, ctx):
        from kvdiag.checks.poison.run import run

        return run(case, ctx)

    def render(self, run, console):
        from kvdiag.checks.poison.view import render

        return render(run, console)

    def reproducer(self, case, run):
        from kvdiag.checks.poison.repro import script

        return script(case, run)
