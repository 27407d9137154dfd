"""``toy``: a check from a plug-in, one folder and one registry line (its distribution's entry point
``toy = toy_kvcheck:CHECK``; tests/integration/test_check_plugin.py installs it). It counts rounds and fails above 3.

Files: ``params.py`` (its options), ``run.py`` (the worker), ``view.py`` (the terminal table), ``tables.py``
(report.md and report.html), ``plots.py`` (report.html), ``compare.py`` (``kvdiag compare``).
"""

from kvdiag.checks.registry import Check
from toy_kvcheck.params import ToyParams

CHECK = Check("toy", "toy_kvcheck.run:run", ToyParams, help="Count rounds, the toy way.\n\nA check from a plug-in.",
              render="toy_kvcheck.view:render", tables="toy_kvcheck.tables:tables", plots="toy_kvcheck.plots:plots",
              compare="toy_kvcheck.compare:rows", isolate=False)
