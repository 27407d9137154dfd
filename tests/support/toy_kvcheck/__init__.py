"""``toy``: a check from a plug-in, one folder and one registry line (its distribution's entry point
``toy = toy_kvcheck:Toy``; tests/integration/test_check_plugin.py installs it). It counts rounds and fails above 3.

Files: ``params.py`` (its options), ``run.py`` (the worker), ``view.py`` (the terminal table), ``tables.py``
(report.md and report.html), ``plots.py`` (report.html), ``compare.py`` (``kvdiag compare``). Each method imports
its module when called.
"""

from kvdiag.checks.registry import Check
from toy_kvcheck.params import ToyParams


class Toy(Check):
    name, params = "toy", ToyParams
    help = "Count rounds, the toy way.\n\nA check from a plug-in."
    isolate = False

    def run(self, case, ctx):
        from toy_kvcheck.run import run

        return run(case, ctx)

    def render(self, run, console):
        from toy_kvcheck.view import render

        return render(run, console)

    def tables(self, run):
        from toy_kvcheck.tables import tables

        return tables(run)

    def plots(self, cases, suffix=""):
        from toy_kvcheck.plots import plots

        return plots(cases, suffix)

    def compare(self, old, new, settings):
        from toy_kvcheck.compare import rows

        return rows(old, new, settings)
