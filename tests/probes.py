"""Running a plain-vLLM probe (tests/vllm_*_probe.py, and kvdiag's side of one) in a process of its own: vLLM's
sleep mode and CuMem allocator start once per process, and a probe must not share kvdiag's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def plain_probe(script: str, *args: str, timeout: float = 900, env: dict | None = None) -> dict:
    """``python3 tests/SCRIPT ARGS``: the JSON of its ``PROBE`` line (the process's stderr when it has none)."""
    p = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[6:])
