"""Plain vLLM, no kvdiag engine: does a CUDA-graph mode give a request other tokens when the batch around it
changes? The truth for ``kvdiag paths``' CUDA-graph paths, which hold each batch layout of a graph engine to the
same layout of the engine without graphs (kvdiag/checks/paths/layouts.py).

    python3 tests/support/vllm_graph_layout_probe.py [MODEL] [--modes NONE,FULL,PIECEWISE]

For each ``cudagraph_mode`` (compiled, one engine per child process: vLLM 0.24 cannot start a second compiled engine
in a process), the 8 prompts of kvdiag's paths check (32 greedy tokens, logprobs) run in one batch of 8, again in
one batch of 8, as 7 then 1, and each alone. Prints, per mode, each layout against its own batch of 8 and against
mode NONE's run of the same layout (max |Δ logprob| before the first divergence, diverged requests).
``VLLM_ATTENTION_BACKEND`` picks the attention backend as in vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kvdiag (prompts, the tiny model) from this checkout
LAYOUTS = ("b8again", "b7+1", "b1")


def child(model: str, mode: str) -> None:
    from vllm import LLM, SamplingParams

    from kvdiag.checks import greedy

    llm = LLM(model=model, dtype="bfloat16", seed=0, max_model_len=256, kv_cache_memory_bytes=64 << 20,
              enforce_eager=False, compilation_config={"cudagraph_mode": mode}, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=32, temperature=0.0, logprobs=1)
    tok = llm.get_tokenizer()
    ps = [{"prompt_token_ids": tok.encode(t)} for t in greedy.prompt_texts(model, 8)]

    def run(batch):
        outs = llm.generate(batch, sp, use_tqdm=False)
        return [[list(o.outputs[0].token_ids), [d[t].logprob for t, d in zip(o.outputs[0].token_ids,
                                                                             o.outputs[0].logprobs)]] for o in outs]

    res = {"b8": run(ps), "b1": [run([p])[0] for p in ps], "b7+1": run(ps[:7]) + run(ps[7:]), "b8again": run(ps)}
    res["mode_ran"] = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name
    print("RES " + json.dumps(res), flush=True)


def in_child(model: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, __file__, model, "--child", mode], capture_output=True, text=True)
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("RES ")), None)
    if line is None:
        return {"error": (out.stderr or out.stdout)[-600:]}
    return json.loads(line[4:])


def dist(a: list, b: list) -> dict:
    d, diverged = 0.0, 0
    for (ta, la), (tb, lb) in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        diverged += n < min(len(ta), len(tb))
        d = max([d] + [abs(x - y) for x, y in zip(la[:n], lb[:n])])
    return {"max_dlogprob": round(d, 4), "diverged": diverged}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="default: kvdiag's shipped tiny model")
    ap.add_argument("--modes", default="NONE,FULL,PIECEWISE")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from kvdiag.assets import TINY_MODEL
    from kvdiag.models import resolve

    model = str(resolve(a.model or str(TINY_MODEL)))
    if a.child:
        child(model, a.child)
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's atexit teardown (a compiled engine can hang in it)
    runs = {m: in_child(model, m) for m in a.modes.split(",")}
    for m, r in runs.items():
        if "error" in r:
            print(json.dumps({"mode": m, "error": r["error"]}))
            continue
        none = runs.get("NONE", {})
        own = {x: dist(r["b8"], r[x]) for x in LAYOUTS}
        print(json.dumps({"mode": m, "ran": r["mode_ran"], "vs_own_batch_of_8": own,
                          "vs_NONE_same_layout": {x: dist(none[x], r[x]) for x in ("b8", "b7+1", "b1") if x in none}}))


if __name__ == "__main__":
    main()
