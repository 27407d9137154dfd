"""The accuracy check: lm_eval + token-level drift per kv dtype, judged against a baseline dtype.

Worker side (``run_case``, one call per dtype): start the engine, save the drift probe
(``checks/sweep/drift.py``) and lm_eval's per-document results as artifacts. Parent side
(``analyze``): pair every dtype's documents with the baseline's, run the paired test,
measure drift, and give each dtype a verdict (``verdicts.py``).

Files: ``params.py`` (its options), ``run.py`` (the worker), ``cases.py`` (the sweep: the baseline first),
``verdict.py`` (the analysis across dtypes), ``view.py`` (the terminal tables), ``tables.py`` (report.md and
report.html), ``plots.py`` (report.html), ``compare.py`` (``kvdiag compare``); kv_needle's grid:
``needle_cases.py`` (its lengths, before any worker starts), ``needle.py`` (each cell's score, the worst cell),
``needle_view.py`` (its tables and heatmaps).
"""

from __future__ import annotations

from kvdiag.checks.accuracy.params import AccuracyParams
from kvdiag.checks.check import Check


class Accuracy(Check):
    name, params = "accuracy", AccuracyParams
    help = "Score lm_eval tasks and token-level drift for each kv dtype against a baseline dtype."
    gpu_share = True
    observes = frozenset({"scores", "tokens"})
    # 10 documents of kv_recall: enough for a collapse; drift (measured in every case) catches what they cannot
    selftest = {"tasks": ["kv_recall"], "include_paths": [], "include_defaults": False, "limit": 10,
                "num_fewshot": None, "seed": 0, "num_prompts": 2}

    def run(self, case, ctx):
        from kvdiag.checks.accuracy.run import run_case

        return run_case(case, ctx)

    def cases(self, target, params):
        from kvdiag.checks.accuracy.cases import cases

        return cases(target, params)

    def render(self, run, console):
        from kvdiag.checks.accuracy.view import render

        return render(run, console)

    def plots(self, cases, suffix=""):
        from kvdiag.checks.accuracy.plots import plots

        return plots(cases, suffix)

    def tables(self, run):
        from kvdiag.checks.accuracy.tables import tables

        return tables(run)

    def compare(self, old, new, settings):
        from kvdiag.checks.accuracy.compare import rows

        return rows(old, new, settings)

    def reproducer(self, case, run):
        from kvdiag.checks.accuracy.repro import script

        return script(case, run)
