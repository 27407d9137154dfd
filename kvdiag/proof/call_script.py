#!/usr/bin/env python3
"""An engine failure kvdiag recorded (a refusal at start, a crash in a call), shown with the engine alone.

In a fresh process the engine starts with every argument and environment variable kvdiag gave it, then makes the
calls below (greedy generate calls, the prompts as token ids) up to the one that died in kvdiag. What the engine
raises is held to what kvdiag saw: the same exception type where kvdiag saw it reproduces.

    python3 THIS_FILE            # exit 1: it dies as kvdiag saw; 0: it does not die; 2: it died otherwise
    python3 THIS_FILE --run 0    # the start and the calls alone, a JSON line each (what the comparison reads)
# only: vllm

Needs only vLLM (and its torch). CASE is what kvdiag recorded; edit it to try another configuration.
# only: builtin

The engine is kvdiag's builtin engine, through its public API alone (``kvdiag.engines.builtin``: ``BuiltinEngine``
started from an ``EngineSpec``): none of kvdiag's checks, runner or commands. Needs kvdiag installed, and torch.
CASE is what kvdiag recorded; edit it to try another configuration.
# only: end
"""

import json
import os
import subprocess
import sys

CASE: dict = {}  # filled in by kvdiag: the engine, its calls, what kvdiag saw and expected
MARK = "@@reproducer-call "


def started(engine: dict):
    """The engine, started as kvdiag started it."""
    # only: vllm
    from vllm import LLM

    return LLM(**engine["llm"])
    # only: builtin
    from kvdiag.engines.builtin import BuiltinEngine, EngineSpec  # the builtin engine's public API

    llm = BuiltinEngine()
    llm.start(EngineSpec(**engine["spec"]))
    return llm
    # only: end


def call(llm, engine: dict, step: dict) -> None:
    """One greedy generate call, as kvdiag made it."""
    # only: vllm
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=step["max_tokens"], temperature=0.0, logprobs=step["logprobs"],
                            **engine["sampling"])
    llm.generate([{"prompt_token_ids": p} for p in step["prompts"]], params, use_tqdm=False)
    # only: builtin
    llm.generate(step["prompts"], step["max_tokens"], greedy=True, logprobs=step["logprobs"])
    # only: end


def said(what: str, e: BaseException) -> str:
    return MARK + json.dumps({"raised": type(e).__name__, "message": str(e).strip()[:600], "at": what})


def engine_run() -> None:
    """The start and each call in this process: a JSON line for the start, for what raised, and ``done``."""
    engine = CASE["engine"]
    os.environ.update(engine["env"])
    try:
        llm = started(engine)
    except Exception as e:  # noqa: BLE001 - the engine's refusal is what the comparison reads
        print(said("the engine's start", e), flush=True)
        return
    print(MARK + json.dumps({"started": True}), flush=True)
    for n, step in enumerate(CASE["calls"], 1):
        try:
            call(llm, engine, step)
        except Exception as e:  # noqa: BLE001 - the engine's failure is what the comparison reads
            print(said(f"call {n} ({len(step['prompts'])} prompt(s), {step['max_tokens']} tokens)", e), flush=True)
            return
    print(MARK + json.dumps({"done": True}), flush=True)


def main() -> int:
    print(f"reproducing: {CASE['title']}")
    print(f"kvdiag saw: {CASE['kvdiag_saw']}")
    print(f"expected: {CASE['expected']}")
    proc = subprocess.run([sys.executable, __file__, "--run", "0"], capture_output=True, text=True)
    end = {}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            end.update(json.loads(line[len(MARK):]))
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    if "raised" in end:
        print(f"observed: {end['at']} raised {end['raised']}: {end['message']}")
        if end["raised"] == CASE["raises"]:
            print(f"REPRODUCED: {end['at']} raised {end['raised']}, as in kvdiag")
            return 1
        print(f"DIED OTHERWISE: {end['raised']}, where kvdiag saw {CASE['raises']}")
        return 2
    if end.get("done"):
        print(f"observed: the engine started and made {len(CASE['calls'])} call(s)")
        print("NOT REPRODUCED: nothing raised")
        return 0
    where = "during a call" if end.get("started") else "before its start ended"
    print(f"observed: the engine's process died {where} (exit {proc.returncode}); the end of its output:\n{tail}")
    if end.get("started") and CASE["calls"]:
        print("REPRODUCED: the engine died in the calls kvdiag made (its process, not only the call)")
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(engine_run() or 0 if sys.argv[1:2] == ["--run"] else main())
