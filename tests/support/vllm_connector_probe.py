"""Plain vLLM, no kvdiag: a KV-connector round trip held to the cold path, and one JSON line.

    python3 tests/support/vllm_connector_probe.py [--model M] [--kv-dtype D] [--block-size B] [--prompts N]
                                                   [--max-tokens T] [--fault layer] [--compiled]

Three processes of this script, one after another, each one ``vllm.LLM`` of the same arguments (eager unless
``--compiled``; ``kv_cache_memory_bytes`` 64 MiB): ``cold`` without a connector runs the prompts greedily twice, the
prefix cache reset before each (``cold_vs_cold``: the noise floor); ``store`` with vLLM's ``ExampleConnector``
(``kv_role`` ``kv_both``, ``shared_storage_path`` a fresh directory) runs them once, so the connector saves each
prompt's full blocks (all but its last token) to safetensors files, a folder per prompt, a file per layer; ``load``
with the same connector runs them once more in a fresh process, loading those blocks. ``load_vs_cold``: the loaded
run against the first cold run (diverged requests, first divergence, largest |Δ logprob| before it, the cold run's
top-2 gap there).

Counters of the load: ``external_tokens`` (the ``num_external_tokens`` the in-process scheduler hands its
connector's ``update_state_after_alloc``, wrapped), ``cached_tokens`` (``RequestOutput.num_cached_tokens``, local
and external; the local prefix cache is empty in a fresh engine) and ``stored`` (folders and files the store wrote).

``--fault layer``: in the load process only, the connector's file reads (``safetensors.torch.load_file``, as the
example connector calls it) of the first cache layer are redirected to the second layer's file: the load must then
differ from cold (``fired``: redirected reads). Exit 0 when the probe ran (whatever it found), 2 when an engine
failed (``error``: vLLM's words).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
TINY = os.path.join(os.path.dirname(__file__), "..", "..", "kvdiag", "assets", "tiny-llama")


def texts(n: int) -> list[str]:
    """``n`` prompts of key=value records, 40 to 100-odd tokens on tiny-llama (a token a byte), each distinct from
    its first characters (no prompt shares a block with another)."""
    out = []
    for i in range(n):
        recs = " ".join(f"k{(i * 7 + j * 13) % 97}=v{(i * 11 + j * 5) % 89};" for j in range(4 + 3 * i))
        out.append(f"{i}# {recs} k{(i * 7) % 97}=")
    return out


def llm_args(a, directory: str | None) -> dict:
    kw = dict(model=a.model, kv_cache_dtype=a.kv_dtype, dtype="bfloat16", seed=0, max_model_len=1024, max_num_seqs=16,
              enforce_eager=not a.compiled, kv_cache_memory_bytes=64 << 20, max_logprobs=20)
    if a.block_size:
        kw["block_size"] = a.block_size
    if directory:
        kw["kv_transfer_config"] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"shared_storage_path": directory}}
    return kw


def run_role(a) -> dict:
    """One engine's part, in this process: its completions and counters."""
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    try:
        llm = LLM(**llm_args(a, a.dir if a.role != "cold" else None))
    except Exception as e:  # noqa: BLE001 - vLLM's refusal or crash is the probe's answer
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    external, fired = [0], [0]
    if sched.connector is not None:
        original = sched.connector.update_state_after_alloc

        def update_state_after_alloc(request, blocks, num_external_tokens, *args, **kw):
            external[0] += int(num_external_tokens or 0)
            return original(request, blocks, num_external_tokens, *args, **kw)

        sched.connector.update_state_after_alloc = update_state_after_alloc
    if a.role == "load" and a.fault == "layer":
        redirect(a.dir, fired)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(x) for x in texts(a.prompts)]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    runs = []
    for _ in range(2 if a.role == "cold" else 1):
        llm.reset_prefix_cache()  # each cold run cold: the second one must not read the first's blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        runs.append([completion(o) for o in outs])
        cached = sum(int(o.num_cached_tokens or 0) for o in outs)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    return {"runs": runs, "prompt_tokens": [len(p) for p in prompts], "external_tokens": external[0],
            "cached_tokens": cached, "fired": fired[0], "block_size": block,
            "seconds": round(time.perf_counter() - t, 1)}


def redirect(directory: str, fired: list) -> None:
    """The fault: a read of the first cache layer's stored file gets the second layer's (the layers' files, named
    ``<layer>.safetensors``, ordered by the first number in their names)."""
    import safetensors.torch

    load = safetensors.torch.load_file

    def load_file(filename, *args, **kwargs):
        folder, name = os.path.split(str(filename))
        if os.path.dirname(folder) == os.path.abspath(directory):
            layers = sorted(os.listdir(folder), key=lambda f: [int(x) for x in re.findall(r"\d+", f)[:1]] or [0])
            if len(layers) > 1 and name == layers[0]:
                fired[0] += 1
                filename = os.path.join(folder, layers[1])
        return load(filename, *args, **kwargs)

    safetensors.torch.load_file = load_file


def completion(o) -> list:
    c = o.outputs[0]
    top = [sorted((x.logprob for x in lp.values()), reverse=True) for lp in c.logprobs]
    return [list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
            [round(t[0] - t[1], 6) if len(t) > 1 else None for t in top]]


def compare(a: list, b: list) -> dict:
    """``b`` against ``a``: requests whose tokens differ, the first position, the largest |Δ logprob| before it."""
    diverged, first, worst, gaps = 0, None, 0.0, []
    for (ta, la, ga), (tb, lb, _) in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if n is not None:
            diverged += 1
            first = n if first is None else min(first, n)
            gaps.append(ga[n])
        worst = max([worst] + [abs(x - y) for x, y in zip(la[:n], lb[:n])])
    return {"diverged_requests": diverged, "first_divergence": first, "max_dlogprob": round(worst, 6),
            "gaps": gaps}


def child(a, role: str, directory: str) -> dict:
    argv = [sys.executable, __file__, "--role", role, "--dir", directory, "--model", a.model, "--kv-dtype",
            a.kv_dtype, "--prompts", str(a.prompts), "--max-tokens", str(a.max_tokens), "--fault", a.fault]
    argv += ["--block-size", str(a.block_size)] if a.block_size else []
    argv += ["--compiled"] if a.compiled else []
    p = subprocess.run(argv, capture_output=True, text=True)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"{role}: exit status {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.abspath(TINY))
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=0, help="0: vLLM's default for the platform")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--fault", choices=("none", "layer"), default="none")
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--role", choices=("cold", "store", "load"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        print(json.dumps(run_role(a)), flush=True)
        return 0
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-connector-probe-") as d:
        parts = {}
        for role in ("cold", "store", "load"):
            parts[role] = child(a, role, d)
            if "error" in parts[role]:
                said = f"{role}: {parts[role]['error']}"
                print(json.dumps({"kv_dtype": a.kv_dtype, "fault": a.fault, "error": said}))
                return 2
        folders = [f for f in os.listdir(d) if os.path.isdir(os.path.join(d, f))]
        files = sum(len(os.listdir(os.path.join(d, f))) for f in folders)
    cold, store, load = (parts[r]["runs"] for r in ("cold", "store", "load"))
    print(json.dumps({
        "kv_dtype": a.kv_dtype, "fault": a.fault, "model": os.path.basename(a.model.rstrip("/")),
        "block_size": parts["load"]["block_size"], "prompt_tokens": parts["cold"]["prompt_tokens"],
        "cold_vs_cold": compare(cold[0], cold[1]), "store_vs_cold": compare(cold[0], store[0]),
        "load_vs_cold": compare(cold[0], load[0]), "external_tokens": parts["load"]["external_tokens"],
        "cached_tokens": parts["load"]["cached_tokens"], "store_external_tokens": parts["store"]["external_tokens"],
        "stored": {"folders": len(folders), "files": files}, "fired": parts["load"]["fired"],
        "seconds": round(time.perf_counter() - t, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
