"""The GPUs of this machine and the ones a worker may use, without importing torch or initialising CUDA (NVML,
else the ``/dev/nvidiaN`` device files). The scheduler (kvdiag/run/scheduling.py) and the memory measurements
(kvdiag/measure/memory.py, kvdiag/measure/processes.py) read them here."""

from __future__ import annotations

import os

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


def current_gpu() -> str | None:
    """The CUDA_VISIBLE_DEVICES entry of torch's current device (its index when the variable is not set), for a
    process that already uses CUDA (a case's worker, one of vLLM's workers): the one function here that asks torch."""
    import torch

    i, ids = torch.cuda.current_device(), visible_gpus()
    return ids[i] if i < len(ids) else None
