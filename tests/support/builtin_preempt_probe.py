"""The builtin engine alone, no paths check: where its preemption run leaves its cold run, and which batch layouts
of the cold path alone move logprobs as much (issue 46: on CUDA in bf16 the check failed preemption, Δ 0.017,
against a floor of 0).

    python3 tests/support/builtin_preempt_probe.py [--device cuda] [--dtype bfloat16] [--kv-dtype auto]

Prints one JSON line: per layout of the cold path (a second cold run, each prompt alone, 4 + 4, 7 + 1, 5 + 3) the
max |Δ logprob| against the cold batch of 8; for the preemption run (the paths check's tight pool, ``-a
preemption=1``) each request's preemptions (generated tokens at that moment), its first position that differs
from the cold run, and the decode batch sizes in order.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MAX_TOKENS = 32


def first_diff(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        if x != y:
            return i
    return None


def max_d(ref, out) -> float:
    from kvdiag.checks import greedy

    return greedy.compare(ref, out).max_dlogprob


def split_run(engine, prompts, sizes) -> list:
    out, i = [], 0
    for n in sizes:
        out += engine.generate(prompts[i:i + n], MAX_TOKENS, greedy=True, logprobs=2)
        i += n
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dtype", default="auto")
    a = ap.parse_args()
    from kvdiag.checks import greedy
    from kvdiag.checks.paths import workload
    from kvdiag.engines.builtin import scheduler as sched
    from kvdiag.engines.builtin.engine import BuiltinEngine
    from kvdiag.engines.protocol import EngineSpec
    from kvdiag.models import resolve

    model = str(resolve("zoo:llama"))
    base = EngineSpec(model=model, device=a.device, dtype=a.dtype, kv_cache_dtype=a.kv_dtype)
    eng = BuiltinEngine()
    eng.start(base)
    prompts = [eng.encode(t) for t in greedy.prompt_texts(model, 8)]
    need = workload.needs(prompts, MAX_TOKENS, base.block_size, a.device)
    eng.shutdown()
    base = replace(base, max_model_len=need["max_model_len"])
    eng.start(base)
    cold = eng.generate(prompts, MAX_TOKENS, greedy=True, logprobs=2)
    layouts = {"second cold": [8], "alone": [1] * 8, "4+4": [4, 4], "7+1": [7, 1], "5+3": [5, 3], "6+2": [6, 2],
               "1+7": [1, 7]}
    res = {"device": a.device, "dtype": a.dtype, "kv_dtype": a.kv_dtype, "need": need,
           "layouts": {k: max_d(cold, split_run(eng, prompts, v)) for k, v in layouts.items()}}
    eng.shutdown()

    events, sizes = [], []
    orig_preempt, orig_decode = sched.Scheduler._preempt, sched.Scheduler._decode

    def preempt(self, r):
        events.append((id(r), len(r.tokens) - len(r.prompt)))
        return orig_preempt(self, r)

    def decode(self):
        sizes.append(len(self.running))
        return orig_decode(self)

    sched.Scheduler._preempt, sched.Scheduler._decode = preempt, decode
    tight = replace(base, num_blocks=need["tight_blocks"], engine_args={"preemption": 1})
    eng = BuiltinEngine()
    eng.start(tight)
    seqs = []
    orig_run = sched.Scheduler.run

    def run(self, reqs):
        seqs[:] = reqs
        return orig_run(self, reqs)

    sched.Scheduler.run = run
    out = eng.generate(prompts, MAX_TOKENS, greedy=True, logprobs=2)
    eng.shutdown()
    ids = {id(r): i for i, r in enumerate(seqs)}
    res["preemption"] = {
        "max_dlogprob": max_d(cold, out), "decode_batch_sizes": sizes,
        "preempted": [(ids[k], at) for k, at in events],
        "first_diff": {i: first_diff(c, o) for i, (c, o) in enumerate(zip(cold, out))},
        "per_request": [max_d([c], [o]) for c, o in zip(cold, out)]}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
