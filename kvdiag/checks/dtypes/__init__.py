"""`kvdiag dtypes --check`: the support matrix of an engine's kv dtypes.

For every dtype string the engine knows: does the engine start with it, does a short
greedy generation come back finite, is an explicit unquantized dtype equal to the
model's dtype bit-identical to ``auto``, is the drift against ``auto`` within the
dtype family's limits (KL growing with the position: a ``drift_grows`` warning, the
row still passes). Rows: ``pass``, ``unsupported`` (the engine's own words),
``resource`` (the device ran out of memory: another engine on the GPU, most often; an
error of the run, never ``unsupported``), ``crashed``, ``wrong``. An explicit unquantized
dtype equal to the model's dtype is what ``auto`` stores: refusing it while ``auto`` works
is ``wrong`` (bug S1), not ``unsupported``. Each dtype runs in its own worker, so one bad
dtype never stops the matrix.

Each row also says what the cache really stores, read from the engine's cache tensors
(``kv_blocks()``; nothing for engines without KV access): the element dtype per layer,
bytes per token of K+V and of the scales. A dtype named as quantized that stores layers
at the model's precision gets a ``not_quantized`` warning (the row still passes).

Files: ``params.py`` (its options), ``run.py`` (the worker), ``cases.py`` (every dtype against 'auto'),
``verdict.py`` (a row per dtype), ``view.py`` (the terminal table), ``tables.py`` (report.md and report.html),
``plots.py`` (report.html).
"""

from __future__ import annotations

from kvdiag.checks.check import Check
from kvdiag.checks.dtypes.params import DtypesParams


class Dtypes(Check):
    name, params = "dtypes", DtypesParams
    help = ("The kv dtype support matrix: does the engine start with each dtype, is the output finite, bit-identical "
            "or within drift of 'auto', and what its cache stores.")
    timeout = 300.0
    gpu_share = True
    observes = frozenset({"scores", "tokens"})
    selftest = {"num_prompts": 2}

    def run(self, case, ctx):
        from kvdiag.checks.dtypes.run import run_case

        return run_case(case, ctx)

    def cases(self, target, params):
        from kvdiag.checks.dtypes.cases import cases

        return cases(target, params)

    def render(self, run, console):
        from kvdiag.checks.dtypes.view import render

        return render(run, console)

    def plots(self, cases, suffix=""):
        from kvdiag.checks.dtypes.plots import plots

        return plots(cases, suffix)

    def tables(self, run):
        from kvdiag.checks.dtypes.tables import tables

        return tables(run)

    def reproducer(self, case, run):
        from kvdiag.checks.dtypes.repro import script

        return script(case, run)
