#!/usr/bin/env python3
"""An engine failure kvdiag recorded (a refusal at start, a crash in a call), shown with the engine alone.

In a fresh process the engine starts with every argument and environment variable kvdiag gave it, then makes the
call that died in kvdiag (a greedy generate call, the prompts as token ids); where that call alone completes and
kvdiag made calls before it in the same engine, a second fresh process makes those first (``CASE["before"]``: each a
generate call, or the prefix cache emptied), then it. What the engine raises is held to what kvdiag saw: the same
exception type reproduces (``CASE["raises"]``; None where kvdiag's process died in the call), and so does an engine
process that dies in the calls.

    python3 THIS_FILE            # exit 1: it dies as kvdiag saw; 0: it does not die; 2: it died otherwise
    python3 THIS_FILE --run 0    # the start and the call alone, a JSON line each (what the comparison reads)
    python3 THIS_FILE --run 1    # the same after the calls before it
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
    """One greedy generate call, as kvdiag made it, or the prefix cache emptied (``reset``)."""
    if step.get("reset"):
        llm.reset_prefix_cache()
        return
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


def engine_run(after: bool) -> None:
    """The start and each call in this process (``after``: the calls before the one that died first): a JSON line
    for the start, for what raised, and ``done``."""
    engine = CASE["engine"]
    os.environ.update(engine["env"])
    try:
        llm = started(engine)
    except Exception as e:  # noqa: BLE001 - the engine's refusal is what the comparison reads
        print(said("the engine's start", e), flush=True)
        return
    print(MARK + json.dumps({"started": True}), flush=True)
    steps = ((CASE.get("before") or []) if after else []) + CASE["calls"]
    for n, step in enumerate(steps, 1):
        try:
            call(llm, engine, step)
        except Exception as e:  # noqa: BLE001 - the engine's failure is what the comparison reads
            what = "emptying the prefix cache" if step.get("reset") else \
                f"{len(step['prompts'])} prompt(s), {step['max_tokens']} tokens"
            print(said(f"call {n} ({what})", e), flush=True)
            return
    print(MARK + json.dumps({"done": True}), flush=True)


def in_fresh_process(after: bool) -> tuple[dict, int, str]:
    """(what the engine's process said, its exit code, the end of its output)."""
    proc = subprocess.run([sys.executable, __file__, "--run", str(int(after))], capture_output=True, text=True)
    end = {}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            end.update(json.loads(line[len(MARK):]))
    return end, proc.returncode, "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])


def main() -> int:
    print(f"reproducing: {CASE['title']}")
    print(f"kvdiag saw: {CASE['kvdiag_saw']}")
    print(f"expected: {CASE['expected']}")
    end, code, tail = in_fresh_process(False)
    if end.get("done") and CASE.get("before"):
        print(f"the call alone completed; again, after the {len(CASE['before'])} call(s) kvdiag made before it in "
              "its engine")
        end, code, tail = in_fresh_process(True)
    if "raised" in end:
        print(f"observed: {end['at']} raised {end['raised']}: {end['message']}")
        if end["raised"] == CASE["raises"]:
            print(f"REPRODUCED: {end['at']} raised {end['raised']}, as in kvdiag")
            return 1
        print(f"DIED OTHERWISE: {end['raised']}, where kvdiag saw " +
              (CASE["raises"] if CASE["raises"] else "its engine's process die"))
        return 2
    if end.get("done"):
        print("observed: the engine started and every call completed")
        print("NOT REPRODUCED: nothing raised")
        return 0
    where = "during a call" if end.get("started") else "before its start ended"
    print(f"observed: the engine's process died {where} (exit {code}); the end of its output:\n{tail}")
    if end.get("started") and CASE["calls"]:
        print("REPRODUCED: the engine died in the calls kvdiag made (its process, not only the call)")
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(engine_run(sys.argv[2:3] == ["1"]) or 0 if sys.argv[1:2] == ["--run"] else main())
