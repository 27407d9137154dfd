"""``memleak``: after an in-process engine shuts down, is the memory back, and if not, what holds it (bug class S4)?

Per kv dtype, in a fresh worker: a baseline snapshot, then each cycle creates and starts a new engine, runs a
short workload (prefill + decode of a few prompts), snapshots, shuts the engine down, cleans up (``gc.collect``,
``torch.cuda.empty_cache`` on CUDA) and snapshots again (waiting up to ``SETTLE_S`` while new tensors are still
alive: an engine's thread may drop its last references late), still holding the engine object: what ``shutdown()``
did not release is named as held by it. The engine's memory is that of every process it started, on every GPU it
uses (``kvdiag/measure/processes.py``). :func:`judge` gives the verdict, one policy for every engine
(docs/DESIGN.md, "memleak"):

- *Retention*: after every shutdown, the first included, memory beyond the baseline on CUDA allocated / reserved
  or live tensor bytes must stay within max(64 MiB, 5% of the engine's peak) (``--threshold``), the driver's
  views (its used memory, NVML's for the engine's processes) within that plus 128 MiB: the CUDA runtime's own
  memory outside torch's allocator, which a process keeps once kernels have run (kernel code, library handles;
  the figure: docs/DESIGN.md, "memleak"). One cycle is enough to fail.
  The finding names the holder: Python referrers, the engine's own pools (vLLM's sleep-mode allocator), CUDA
  private pools (CUDA graphs), processes the engine left running, else "held outside Python objects".
- *Growth*: the exact measures (tensor bytes, CUDA allocated, CUDA reserved) may not grow by more than 4 MiB in
  every step from one cycle to the next; the noisy ones (RSS, driver used, NVML) by more than max(16 MiB, 1% of
  the peak) in every step.
- *Survivors* (tensors the census sees that the baseline did not have): the same small set every cycle is a
  warning with its holder; a set whose count or bytes grow every cycle fails.
- *Sized by the KV cache*, per holder: the surviving storages one holder keeps (a module global, an object, a
  closure), summed, fail when they reach 1% of the engine's KV cache, whatever the retention limit (``kv_scaled.py``):
  they grow with the user's cache, and one tensor per layer is the same leak cut into pieces.
- *Shaped by the KV cache*: any survivor whose leading dimensions index the cache's blocks or token slots (per layer,
  K/V or stacked layers) fails, whatever its size (``kv_shape.py``).
- *Two KV sizes* (``--kv-sizes A,B``): the cycles run at A then B blocks; a holder whose surviving bytes follow the
  cache's ratio is proportional to it, proven by the two measurements, and fails (``kv_ratio.py``). Growth from cycle
  to cycle is judged within a size.
- *The KV cache by identity*: any storage of the engine's KV cache or scale tensors (its ``kv_blocks()`` view
  during the workload) still alive after shutdown fails, whatever its size, with its holder (``kv_identity.py``).
- *Restart impossible*: an engine that started once and cannot start again in this process (vLLM sleep mode on
  CUDA) fails with the engine's message; the cycles before it are judged.
- Objects left frozen by ``gc.freeze()`` fail.
- *Processes* the engine started and did not stop: ``leftover.py``.

Files: ``params.py`` (its options), ``run.py`` (the worker: cycles and snapshots), ``verdict.py`` (:func:`judge`:
the policy above), ``kv_identity.py``, ``kv_scaled.py``, ``kv_shape.py``, ``kv_ratio.py``, ``surviving.py``,
``leftover.py`` and ``restart.py`` (what survived, and why), ``repro.py`` (a failure's standalone script),
``view.py`` (the terminal tables, report.md's
``--kv-sizes`` table), ``plots.py`` (report.html), ``compare.py`` (``kvdiag compare``).
"""

from __future__ import annotations

from kvdiag.checks.check import Check
from kvdiag.checks.memleak.params import HELP, LeakParams


class Memleak(Check):
    name, params, help = "memleak", LeakParams, HELP
    isolate = False
    observes = frozenset({"memory"})
    selftest = {"cycles": 2, "num_prompts": 2, "max_tokens": 4, "num_blocks": 16}

    def run(self, case, ctx):
        from kvdiag.checks.memleak.run import run

        return run(case, ctx)

    def render(self, run, console):
        from kvdiag.checks.memleak.view import render

        return render(run, console)

    def plots(self, cases, suffix=""):
        from kvdiag.checks.memleak.plots import plots

        return plots(cases, suffix)

    def compare(self, old, new, settings):
        from kvdiag.checks.memleak.compare import rows

        return rows(old, new, settings)

    def tables(self, run):
        from kvdiag.checks.memleak.view import tables

        return tables(run)

    def reproducer(self, case, run):
        from kvdiag.checks.memleak.repro import script

        return script(case, run)
