"""``paths``: does every path the KV cache takes give what the cold path gives?

Users now find KV bugs where the cache reaches attention by another path than one cold prefill and decode:
prefix-cache hits, preemption and recompute, chunked prefill, CUDA-graph modes, speculative decoding, CPU offload,
a decode past a sliding layer's window (its blocks freed and reused; held to a prefill of the same tokens).
Per kv dtype and path (``catalogue.py``), the same fixed prompts run greedily cold (twice, and reordered: the
engine's noise floor, ``floor.py``), then through the path; a path fails when it changes a greedy token beyond a
near-tie, or moves logprobs beyond the floor. A path the engine or platform cannot run is ``unsupported`` in its
words (``EngineTraits.path_config``, or the engine's refusal at start).

Files: ``catalogue.py`` (the paths), ``params.py`` (its options and cases), ``workload.py`` (prompts and sizes),
``run.py`` (the worker), ``sliding.py`` (the sliding-window path), ``floor.py`` (distance and noise floor),
``verdict.py``, ``view.py`` (terminal table), ``tables.py`` (report.md and report.html), ``compare.py``
(``kvdiag compare``), ``repro.py`` (a failing case's standalone script, ``kvdiag.proof``).
"""

from __future__ import annotations

from kvdiag.checks.check import Check
from kvdiag.checks.paths.params import HELP, PathsParams


class Paths(Check):
    name, params, help = "paths", PathsParams, HELP
    kv_dtypes = ("auto", "fp8")
    gpu_share = True
    observes = frozenset({"kv_paths", "tokens"})
    selftest = {"num_prompts": 4, "max_tokens": 12, "seed": 0}

    def run(self, case, ctx):
        from kvdiag.checks.paths.run import run

        return run(case, ctx)

    def variants(self, params):
        from kvdiag.checks.paths.params import variants

        return variants(params)

    def analyze(self, run, params):
        from kvdiag.checks.paths.params import analyze

        return analyze(run, params)

    def spread(self, case):
        from kvdiag.checks.paths.params import spread

        return spread(case)

    def render(self, run, console):
        from kvdiag.checks.paths.view import render

        return render(run, console)

    def tables(self, run):
        from kvdiag.checks.paths.tables import tables

        return tables(run)

    def compare(self, old, new, settings):
        from kvdiag.checks.paths.compare import rows

        return rows(old, new, settings)

    def reproducer(self, case, run):
        from kvdiag.checks.paths.repro import script

        return script(case, run)
