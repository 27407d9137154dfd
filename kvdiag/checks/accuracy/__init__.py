"""The accuracy check: lm_eval + token-level drift per kv dtype, judged against a baseline dtype.

Worker side (``run_case``, one call per dtype): start the engine, save the drift probe
(``checks/drift.py``) and lm_eval's per-document results as artifacts. Parent side
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

CHECK = Check(
    "accuracy", "kvdiag.checks.accuracy.run:run_case", AccuracyParams,
    help="Score lm_eval tasks and token-level drift for each kv dtype against a baseline dtype.",
    render="kvdiag.checks.accuracy.view:render", plots="kvdiag.checks.accuracy.plots:plots",
    tables="kvdiag.checks.accuracy.tables:tables",
    compare="kvdiag.checks.accuracy.compare:rows", cases="kvdiag.checks.accuracy.cases:cases", gpu_share=True,
    reproducer="kvdiag.checks.accuracy.repro:script",
    # 10 documents of kv_recall: enough for a collapse; drift (measured in every case) catches what they cannot
    selftest={"tasks": ["kv_recall"], "include_paths": [], "include_defaults": False, "limit": 10,
              "num_fewshot": None, "seed": 0, "num_prompts": 2})
