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

CHECK = Check("paths", "kvdiag.checks.paths.run:run", PathsParams, help=HELP,
              variants="kvdiag.checks.paths.params:variants", analyze="kvdiag.checks.paths.params:analyze",
              render="kvdiag.checks.paths.view:render",
              tables="kvdiag.checks.paths.tables:tables", compare="kvdiag.checks.paths.compare:rows",
              spread="kvdiag.checks.paths.params:spread", kv_dtypes=("auto", "fp8"), gpu_share=True,
              selftest={"num_prompts": 4, "max_tokens": 12, "seed": 0},
              reproducer="kvdiag.checks.paths.repro:script")
