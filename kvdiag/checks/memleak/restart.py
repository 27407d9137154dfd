"""memleak's plain restart (docs/DESIGN.md, "memleak"): when an engine cannot start again in kvdiag's worker, is
that the engine's doing or kvdiag's? The engine's own reproducer for a restart (``reproducer(engine, "restart")``:
for vLLM a plain script that starts ``vllm.LLM`` with the case's arguments, runs a request, shuts down as kvdiag
does and starts again) runs in a fresh process. When it restarts there, the failure is kvdiag's own interference;
when it fails too, the engine cannot restart, and the finding gives the plain command that shows it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

STAGE = "restart"
TIMEOUT_S = 900  # two engine starts; a compiled vLLM start on a fresh machine takes minutes


def plain(engine: str, timeout: float = TIMEOUT_S) -> dict | None:
    """``{"command", "restarted", "cause", "seconds"}`` of the engine's plain restart in a fresh process; None when
    the engine gives no reproducer (then the worker's failure stands alone). ``restarted`` is None on a timeout."""
    from kvdiag.death import cause
    from kvdiag.engines.base import reproducer

    cmd = reproducer(engine, STAGE)
    if not cmd:
        return None
    t = time.perf_counter()
    # the command says python3 for a person to run; here it runs under this worker's interpreter (a venv's
    # kvdiag started without activating it would otherwise get a python3 without the engine)
    run = shlex.quote(sys.executable) + cmd[len("python3"):] if cmd.startswith("python3 ") else cmd
    try:
        p = subprocess.run(["bash", "-c", run], capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"command": cmd, "restarted": None, "cause": f"no answer in {timeout:.0f} s",
                "seconds": round(time.perf_counter() - t, 1)}
    ok = p.returncode == 0
    return {"command": cmd, "restarted": ok, "cause": None if ok else
            (cause(p.stdout + "\n" + p.stderr).line or f"exit status {p.returncode}"),
            "seconds": round(time.perf_counter() - t, 1)}
