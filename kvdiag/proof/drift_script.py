#!/usr/bin/env python3
"""A drift kvdiag found between a kv dtype and its baseline dtype, shown with the engine alone.

In a fresh process the baseline's engine starts with every argument and environment variable kvdiag gave it and
scores each continuation below after its context, teacher-forced, keeping the whole next-token distribution at each
continuation token; then the dtype's engine does the same. The two are compared position by position as kvdiag
compares them: KL(baseline || dtype), top-1 agreement (the dtype's top token one the baseline ranks within
``CASE["tie_nats"]`` of its own top), |Δ logprob| of the continuation's token; and the mean and the largest held to
the dtype family's limits kvdiag judged the case by (``CASE["limits"]``: kvdiag's calibrated numbers, carried here).

    python3 THIS_FILE            # exit 1: beyond a limit, as kvdiag saw; 0: within them; 2: an engine did not run
    python3 THIS_FILE --run 0    # both engines' scores compared, in this process: a JSON line (what is judged)

The engine is kvdiag's builtin engine, through its public API alone (``kvdiag.engines.builtin``: ``BuiltinEngine``
started from an ``EngineSpec``, its ``score``): none of kvdiag's checks, runner or commands. Needs kvdiag installed,
and torch. CASE is what kvdiag recorded; edit it to try another configuration.
"""

import json
import math
import os
import subprocess
import sys

CASE: dict = {}  # filled in by kvdiag: the two engines, the contexts and continuations, the limits, what kvdiag saw
MARK = "@@reproducer-drift "


def scored(engine: dict) -> list:
    """Each continuation's logprobs at every position ([tokens, vocab], float64) and its tokens' logprobs."""
    import torch

    from kvdiag.engines.builtin import BuiltinEngine, EngineSpec  # the builtin engine's public API

    os.environ.update(engine["env"])
    llm = BuiltinEngine()
    llm.start(EngineSpec(**engine["spec"]))
    out = [(torch.as_tensor(s.distributions).double().cpu(), list(s.logprobs))
           for s in llm.score(CASE["contexts"], CASE["continuations"], top_k=-1)]
    llm.shutdown()
    return out


def compared() -> dict:
    """Both engines' scores, position by position: KL, top-1 agreement, |Δ logprob|, and where KL is largest."""
    import torch

    base, test = scored(CASE["engines"]["baseline"]), scored(CASE["engines"]["dtype"])
    kls, agree, moved, worst = [], [], [], (-1.0, None, None)
    for i, ((p, pc), (q, qc)) in enumerate(zip(base, test)):
        terms = torch.where(p > -math.inf, p.exp() * (p - q), torch.zeros_like(p))
        kl = terms.sum(-1).clamp(min=0.0)  # NaN stays NaN
        picked = p.gather(-1, q.argmax(-1, keepdim=True))[:, 0]
        kls += kl.tolist()
        agree += (picked >= p.max(-1).values - CASE["tie_nats"]).tolist()
        moved += [abs(x - y) for x, y in zip(pc, qc)]
        j = int(kl.nan_to_num(math.inf).argmax()) if kl.numel() else None
        if j is not None and not float(kl[j]) <= worst[0]:  # NaN: the worst
            worst = (float(kl[j]), i, j)
    nan = float("nan")
    return {"positions": len(kls), "mean_kl": sum(kls) / len(kls) if kls else nan,
            "max_kl": nan if any(x != x for x in kls) else max(kls, default=nan),
            "top1_agreement": sum(agree) / len(agree) if agree else nan,
            "max_abs_dlogprob": nan if any(x != x for x in moved) else max(moved, default=nan),
            "worst": {"kl": worst[0], "prompt": worst[1], "position": worst[2]}}


def beyond(got: dict, lim: dict) -> list[str]:
    """Each measure beyond its limit (NaN is beyond every limit)."""
    said = []
    for key, limit, worse in (("mean_kl", lim["mean_kl"], lambda v, t: v > t),
                              ("max_kl", lim["max_kl"], lambda v, t: v > t),
                              ("top1_agreement", lim["min_top1"], lambda v, t: v < t),
                              ("max_abs_dlogprob", lim["max_abs_dlogprob"], lambda v, t: v > t)):
        v = got[key]
        if v != v or worse(v, limit):
            said.append(f"{key} {v:.4g} beyond the {lim['family']} limit {limit:g}")
    return said


def main() -> int:
    print(f"reproducing: {CASE['title']}")
    print(f"kvdiag saw: {CASE['kvdiag_saw']}")
    lim = CASE["limits"]
    print(f"expected: within kvdiag's {lim['family']} limits: mean KL <= {lim['mean_kl']:g}, max KL <= "
          f"{lim['max_kl']:g}, top-1 agreement >= {lim['min_top1']:g}, max |Δ logprob| <= {lim['max_abs_dlogprob']:g}")
    proc = subprocess.run([sys.executable, __file__, "--run", "0"], capture_output=True, text=True)
    got = next((json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)), None)
    if got is None:
        print(f"the engines did not run (exit {proc.returncode}); the end of their output:", file=sys.stderr)
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-30:]), file=sys.stderr)
        return 2
    w = got["worst"]
    print(f"observed over {got['positions']} positions: mean KL {got['mean_kl']:.4g}, max KL {got['max_kl']:.4g}, "
          f"top-1 agreement {got['top1_agreement']:.4g}, max |Δ logprob| {got['max_abs_dlogprob']:.4g}; the largest KL "
          f"at prompt {w['prompt']}, continuation token {w['position']}")
    said = beyond(got, lim)
    for line in said:
        print("  " + line)
    if said:
        print(f"REPRODUCED: {len(said)} measure(s) beyond kvdiag's {lim['family']} limits")
        return 1
    print(f"NOT REPRODUCED: within kvdiag's {lim['family']} limits")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        print(MARK + json.dumps(compared()), flush=True)
        sys.exit(0)
    sys.exit(main())
