"""``wake-cycle``: does the engine survive sleep/wake cycles (bug class S2)?

Greedy outputs (tokens, logprobs) of the prompt set are recorded once; then each cycle
zeroes the free blocks of the old cache (what a stale read after wake would see, as when
freed memory is reused), sleeps at ``level``, measures what was freed against the
expected bytes (KV cache; plus weights at level 2, and at level 1 when weights leave the
cache's device), wakes (all tags, or ``weights`` then ``kv_cache``), measures what came
back, regenerates and compares token for token, then scans the KV slots the
regeneration wrote for NaN/Inf.

Files: ``params.py`` (its options), ``run.py`` (the worker), ``mem_probe.py`` (memory per sleep tag), ``view.py``
(the terminal table), ``plots.py`` (report.html).
"""

from __future__ import annotations

from kvdiag.checks.check import Check
from kvdiag.checks.wake_cycle.params import HELP, WakeParams


class WakeCycle(Check):
    name, params, help = "wake-cycle", WakeParams, HELP
    observes = frozenset({"sleep", "tokens"})  # sleep: what a sleep frees and a wake brings back, outputs after it
    selftest = {"cycles": 1, "num_prompts": 2, "max_tokens": 8, "num_blocks": 16, "seed": 0}

    def run(self, case, ctx):
        from kvdiag.checks.wake_cycle.run import run

        return run(case, ctx)

    def variants(self, params):
        from kvdiag.checks.wake_cycle.params import variants

        return variants(params)

    def render(self, run, console):
        from kvdiag.checks.wake_cycle.view import render

        return render(run, console)

    def plots(self, cases, suffix=""):
        from kvdiag.checks.wake_cycle.plots import plots

        return plots(cases, suffix)

    def reproducer(self, case, run):
        from kvdiag.checks.wake_cycle.repro import script

        return script(case, run)
