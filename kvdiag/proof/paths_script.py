#!/usr/bin/env python3
"""A failure kvdiag's ``paths`` check found, shown with the engine alone.

Each engine starts in a fresh process, with every argument and environment variable kvdiag gave it, and runs the
prompts (their token ids are below) greedily, call by call, as kvdiag did: the reference run (the cold path) and the
path's run, in one engine or two. The path's output is then held to the reference's as kvdiag holds it: a greedy token
that changes where the reference's top two were further apart than the tolerance, a logprob that moves by more than
it before that, or a NaN/inf.

    python3 THIS_FILE              # exit 1: the failure reproduces; 0: it does not; 2: an engine did not run
    python3 THIS_FILE --run 0      # the first engine's outputs alone, as JSON (what the comparison reads)
# only: vllm

Where kvdiag ran the case batch-invariant (``paths --batch-invariant``), the script sets vLLM's switch
(``CASE["batch_invariance"]``, ``VLLM_BATCH_INVARIANT=1``) in its own environment before vLLM is imported, and says
so first: then any difference belongs to the path, and the tolerance is 0.

Needs only vLLM (and its torch). CASE is what kvdiag recorded; edit it to try another configuration.
# only: builtin

The engine is kvdiag's builtin engine, through its public API alone (``kvdiag.engines.builtin``: ``BuiltinEngine``
started from an ``EngineSpec``): none of kvdiag's checks, runner or commands. Needs kvdiag installed, and torch.
CASE is what kvdiag recorded; edit it to try another configuration.
# only: end
"""

import json
import math
import os
import subprocess
import sys

CASE: dict = {}  # filled in by kvdiag: the engines, each engine's calls, the tolerance and what kvdiag saw
MARK = "@@reproducer-output "


def engine_run(index: int) -> dict:
    """One engine's steps, in this process: each a generate call after an emptied prefix cache where it says
    ``reset``; its outputs kept under its ``as`` (reference or path; a step without one only fills the cache)."""
    run = CASE["runs"][index]
    engine = CASE["engines"][run["engine"]]
    os.environ.update({**(CASE.get("batch_invariance") or {}), **engine["env"]})
    if run.get("empty_dir"):  # a KV connector's store: this engine stores the prompts, the next loads them
        import shutil

        shutil.rmtree(run["empty_dir"], ignore_errors=True)
    llm = started(engine)
    out, kept = {"reference": {}, "path": {}}, {}
    for step in run["steps"]:
        if step["reset"]:
            llm.reset_prefix_cache()
        prompts = step["prompts"]
        if step.get("cuts"):  # each (prompt, cut): the prompt and the tokens a decode kept gave up to the cut
            prompts = [prompts[i] + kept[step["from"]][str(i)]["token_ids"][:k] for i, k in step["cuts"]]
        got = dict(zip(step["labels"], greedy(llm, engine, prompts, step["max_tokens"])))
        kept[step.get("keep")] = got
        if step.get("past"):  # compared from these positions on; the tokens before them must agree (``inside``)
            got = {label: {"inside": r["token_ids"][:step["past"][label]],
                           **{key: r[key][step["past"][label]:] for key in ("token_ids", "logprobs", "top")}}
                   for label, r in got.items()}
        cuts = (step.get("cuts") or ()) if step.get("as") else ()  # a compared cut's reference: the decode's token
        for (i, k), label in zip(cuts, step["labels"]):
            out["reference"][label] = {key: v[k:k + 1] for key, v in kept[step["from"]][str(i)].items()}
        if step.get("as"):
            out[step["as"]].update(got)
    if run.get("drop_dir"):  # the store the engines before this one wrote, read: nothing needs it now
        import shutil

        shutil.rmtree(run["drop_dir"], ignore_errors=True)
    return out


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


def greedy(llm, engine: dict, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Each prompt's greedy tokens, their logprobs and the top two logprobs at each of them, in one generate call."""
    # only: vllm
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=CASE["logprobs"], **engine["sampling"])
    got = []
    for result in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        c = result.outputs[0]
        tops = [sorted((lp.logprob for lp in pos.values()), reverse=True)[:2] for pos in c.logprobs or []]
        chosen = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs or [])]
        got.append({"token_ids": list(c.token_ids), "logprobs": chosen, "top": tops})
    return got
    # only: builtin
    return [{"token_ids": list(c.token_ids), "logprobs": list(c.logprobs),
             "top": [sorted(pos.values(), reverse=True)[:2] for pos in c.top_logprobs or []]}
            for c in llm.generate(prompts, max_tokens, greedy=True, logprobs=CASE["logprobs"])]
    # only: end


def in_fresh_process(index: int) -> dict | None:
    """``engine_run(index)`` in a fresh process (an engine that captured CUDA graphs cannot start again in its
    process), None when it did not finish (its output's end is printed)."""
    proc = subprocess.run([sys.executable, __file__, "--run", str(index)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    name = CASE["runs"][index]["engine"]
    print(f"the {name} engine did not run (exit {proc.returncode}); the end of its output:", file=sys.stderr)
    print("\n".join((proc.stdout + proc.stderr).splitlines()[-30:]), file=sys.stderr)
    return None


def held(ref: dict, got: dict, tol: float, share: dict | None = None) -> list[str]:
    """What ``got`` does beyond ``tol`` against ``ref`` (one line per request): [] when it matches. With ``share``,
    logprobs are judged as a whole by the share of positions that moved by more than ``share["moved_by"]``
    before each request's first divergence, at most ``share["allowed"]``."""
    said, moves = [], []
    for label, a in ref.items():
        b = got[label]
        if a.get("inside") != b.get("inside"):  # apart before the compared positions: kvdiag leaves it out
            print(f"  request {label}: left out, as kvdiag leaves it out: its tokens differ before the compared "
                  "positions")
            continue
        pos = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), None)
        if pos is None and len(a["token_ids"]) != len(b["token_ids"]):
            pos = min(len(a["token_ids"]), len(b["token_ids"]))
        upto = len(b["token_ids"]) if pos is None else pos
        steps = [abs(x - y) for x, y in zip(a["logprobs"][:upto], b["logprobs"][:upto])]
        moves += steps
        moved = max(steps, default=0.0)
        bad = [lp for lp in b["logprobs"] if not math.isfinite(lp)]
        why = []
        if pos is not None:
            top = a["top"][pos] if pos < len(a["top"]) else []
            gap = top[0] - top[1] if len(top) == 2 else None
            if gap is None or gap > tol:
                expected = a["token_ids"][pos] if pos < len(a["token_ids"]) else "end"
                found = b["token_ids"][pos] if pos < len(b["token_ids"]) else "end"
                why.append(f"token {pos} is {found}, the reference's {expected} (its top two "
                           + (f"{gap:.3g} apart)" if gap is not None else "not known)"))
        if moved > tol and not share:
            why.append(f"a logprob moved {moved:.3g} before that")
        if bad:
            why.append(f"{len(bad)} non-finite logprob(s)")
        if why:
            said.append(f"request {label}: " + "; ".join(why))
    if share and moves:
        n = sum(not m <= share["moved_by"] for m in moves)  # NaN: moved
        if n / len(moves) > share["allowed"]:
            said.append(f"{n}/{len(moves)} positions moved (|Δ logprob| > {share['moved_by']:g}) before any "
                        f"divergence: a share of {n / len(moves):.3g} > {share['allowed']:.3g}")
    return said


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        print(MARK + json.dumps(engine_run(int(sys.argv[2]))), flush=True)
        return 0
    print(f"reproducing: {CASE['title']}")
    print(f"kvdiag saw: {CASE['kvdiag_saw']}")
    # only: vllm
    if CASE.get("batch_invariance"):  # before any vLLM import: vLLM reads it once, where its kernels are chosen
        os.environ.update(CASE["batch_invariance"])
        print("batch-invariant, as kvdiag ran it (paths --batch-invariant): "
              + " ".join(f"{k}={v}" for k, v in CASE["batch_invariance"].items()) + " set in this script's "
              "environment before vLLM is imported; the reference and the path must then agree exactly")
    # only: end
    runs = {"reference": {}, "path": {}}
    for i in range(len(CASE["runs"])):
        got = in_fresh_process(i)
        if got is None:
            return 2
        for role in runs:
            runs[role].update(got[role])
    tol = CASE["tolerance"]
    said = held(runs["reference"], runs["path"], tol, CASE.get("share"))
    for line in said:
        print("  " + line)
    if said:
        share = CASE.get("share")
        print(f"REPRODUCED: {len(said)} of {len(runs['reference'])} requests differ beyond the tolerance {tol:.3g}"
              if not share else f"REPRODUCED: {len(said)} difference(s) beyond kvdiag's rule in "
              f"{len(runs['reference'])} requests (tolerance {tol:.3g}, a share of at most {share['allowed']:.3g} "
              "of positions moved)")
        return 1
    print(f"NOT REPRODUCED: the path matched the reference in all {len(runs['reference'])} requests "
          f"(tolerance {tol:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
