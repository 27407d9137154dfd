"""The ``sliding-window`` path of tests/support/vllm_paths_probe.py, in plain vLLM: a greedy generation past a
sliding layer's window (vLLM frees the blocks behind the window during decode and hands them out again) held to a
prefill of the same tokens, at cuts past the window; cuts inside it are the floor. The truth kvdiag's
``paths -p sliding-window`` (kvdiag/checks/paths/sliding.py) is held to.

The window is the config's (checked against the SlidingWindowSpec vLLM builds). Prompts are cut to half a window
(less 3, 2, 1, 0 tokens: a request one token ahead of the one before it allocates in the step where that
one frees a block, and gets it); each generates two
windows and a block. The pool: per request its full layers' blocks plus ``ceil(window / block) + 1`` sliding ones,
two over: tight, so a freed block goes out again at once. ``alone``: each prompt decoded by itself, its past-window
positions against the same prefills (the noise there: no other request takes the blocks it frees);
``batch_vs_alone``: the batch's decode against each lone decode, inside the window and past it. Counted by wraps
of the in-process scheduler:
``freed`` (blocks the sliding managers replaced by the null block), ``reused_while_owner_runs`` (such blocks
handed out again while the request that freed them still runs), ``reused_by_another`` (of those, to another
request), ``min_free_blocks`` (the pool's fewest free blocks), and vLLM's preemption metric.

``swa_frees_window_block`` (``--fault``): ``SlidingWindowManager.get_num_skipped_tokens`` returns one block more
whenever it is positive, so a block still inside the window is freed and reused: a test-only fault that the
comparison must see.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

FAULTS = ("swa_frees_window_block",)


def patch_fault(name: str) -> dict:
    """Patch ``name`` into vLLM's class; returns how often the patched code changed a result (a live dict)."""
    from vllm.v1.core import single_type_kv_cache_manager as m

    fired = {name: 0}
    original = m.SlidingWindowManager.get_num_skipped_tokens

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        n = original(self, num_computed_tokens)
        if n > 0:
            fired[name] += 1
            return n + self.block_size
        return n

    m.SlidingWindowManager.get_num_skipped_tokens = get_num_skipped_tokens
    return fired


def window_of(model: str) -> int | None:
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    types = cfg.get("layer_types")
    if not cfg.get("sliding_window") or (types is not None and "sliding_attention" not in types):
        return None
    return int(cfg["sliding_window"])


class Counts:
    """Wraps each manager's ``allocate_new_blocks`` and the sliding managers' ``remove_skipped_blocks``."""

    def __init__(self, llm):
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        self.sched, self.pool = sched, sched.kv_cache_manager.block_pool
        self.freed, self.reused, self.by_other, self.owner = 0, 0, 0, {}
        self.min_free = self.pool.get_num_free_blocks()
        for mgr in sched.kv_cache_manager.coordinator.single_type_managers:
            if type(mgr).__name__ == "SlidingWindowManager":
                mgr.remove_skipped_blocks = self._remove(mgr, mgr.remove_skipped_blocks)
            mgr.allocate_new_blocks = self._allocate(mgr.allocate_new_blocks)

    def _allocate(self, original):
        def allocate_new_blocks(request_id, *a, **k):
            out = original(request_id, *a, **k)
            running = {r.request_id for r in self.sched.running}
            for b in out:
                owner = self.owner.pop(b.block_id, None)
                self.reused += int(owner in running)
                self.by_other += int(owner in running and owner != request_id)
            self.min_free = min(self.min_free, self.pool.get_num_free_blocks())
            return out

        return allocate_new_blocks

    def _remove(self, mgr, original):
        def remove_skipped_blocks(request_id, *a, **k):
            before = {b.block_id for b in mgr.req_to_blocks.get(request_id, ()) if not b.is_null}
            out = original(request_id, *a, **k)
            after = {b.block_id for b in mgr.req_to_blocks.get(request_id, ()) if not b.is_null}
            self.freed += len(before - after)
            self.owner.update({b: request_id for b in before - after})
            return out

        return remove_skipped_blocks


def cuts(n_prompt: int, window: int, block: int, tokens: int, i: int) -> tuple[list[int], list[int]]:
    last = n_prompt + tokens - 1
    inside = [n for n in sorted({window - window // 4, window - 1}) if n >= n_prompt]
    past = [n for n in sorted({min(window + block + i % max(1, block // 2), last), (window + block + last) // 2,
                               last}) if n > window]
    return [n - n_prompt for n in inside], [n - n_prompt for n in past]


def run(model: str, texts: list[str], kv_dtype: str, block: int, fault: str | None, metrics) -> dict:
    from vllm import LLM, SamplingParams

    window = window_of(model)
    if window is None:
        return {"supported": False, "reason": "the model's config has no sliding-window layer"}
    fired = patch_fault(fault) if fault else {}
    tokens, n = max(2 * window + block, window + 2 * block), len(texts)
    longest = window // 2 + tokens
    pool = n * (-(-longest // block) + -(-window // block) + 1) + 2
    t = time.time()
    llm = LLM(model=model, kv_cache_dtype=kv_dtype, dtype="bfloat16", block_size=block, seed=0, enforce_eager=True,
              max_model_len=-(-longest // block) * block, max_num_seqs=n, max_num_batched_tokens=2048,
              enable_prefix_caching=False, num_gpu_blocks_override=pool, kv_cache_memory_bytes=64 << 20,
              disable_log_stats=False)
    start = round(time.time() - t, 2)
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in groups]
    assert window in windows, (window, windows)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(x)[:window // 2 - 3 + i % 4] for i, x in enumerate(texts)]
    counts = Counts(llm)
    before = metrics(llm).get("preemptions", 0)
    sp = dict(temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=tokens, **sp),
                        use_tqdm=False)
    dec = [o.outputs[0] for o in outs]
    freed, reused, by_other, min_free = counts.freed, counts.reused, counts.by_other, counts.min_free
    pairs = {"inside": [], "past": []}
    for i, (p, d) in enumerate(zip(prompts, dec)):
        inside, past = cuts(len(p), window, block, len(d.token_ids), i)
        pairs["inside"] += [(i, k) for k in inside]
        pairs["past"] += [(i, k) for k in past]
    every = pairs["inside"] + pairs["past"]
    fed = llm.generate([{"prompt_token_ids": prompts[i] + list(dec[i].token_ids[:k])} for i, k in every],
                       SamplingParams(max_tokens=1, **sp), use_tqdm=False)
    # each prompt decoded alone: the only request to take a block it frees is itself; its decode past the window
    # against the same prefills is the noise there (a fault that hands a block to another request cannot fire)
    alone = [llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=tokens, **sp), use_tqdm=False)[0]
             .outputs[0] for p in prompts]
    preemptions = metrics(llm).get("preemptions", 0) - before
    res = {"supported": True, "reason": "", "window": window, "block_size": block, "generated": tokens,
           "num_gpu_blocks": pool, "min_free_blocks": min_free, "freed": freed, "reused_while_owner_runs": reused,
           "reused_by_another": by_other,
           "preemptions": preemptions, "prompt_tokens": [len(p) for p in prompts], "llm_start_s": start,
           "fired": dict(fired)}
    for name, part in (("inside", pairs["inside"]), ("past", pairs["past"])):
        dlp, diverging = 0.0, []
        for (i, k), f in zip(part, fed[:len(pairs["inside"])] if name == "inside" else fed[len(pairs["inside"]):]):
            want, got = dec[i].token_ids[k], f.outputs[0].token_ids[0]
            if want != got:
                diverging.append([i, k, want, got])
            else:
                dlp = max(dlp, abs(dec[i].logprobs[k][want].logprob - f.outputs[0].logprobs[0][got].logprob))
        res[name] = {"cuts": len(part), "max_dlogprob": dlp, "diverging": diverging}
    dlp, compared = 0.0, 0
    for (i, k), f in zip(pairs["past"], fed[len(pairs["inside"]):]):
        got = f.outputs[0].token_ids[0]
        if list(alone[i].token_ids[:k + 1]) == list(dec[i].token_ids[:k + 1]) and got == dec[i].token_ids[k]:
            compared += 1
            dlp = max(dlp, abs(alone[i].logprobs[k][got].logprob - f.outputs[0].logprobs[0][got].logprob))
    res["alone"] = {"cuts": compared, "max_dlogprob": dlp}
    res["batch_vs_alone"] = batch_vs_alone(dec, alone, [len(p) for p in prompts], window)
    return res


STEPS = (1e-4, 1e-2, 0.05, 0.1)  # |Δ logprob| past which a position counts as moved (``over``)


def batch_vs_alone(dec, alone, lengths: list[int], window: int) -> dict:
    """The batch's decode against each prompt's lone decode, position by position up to their first different
    token: ``inside`` the window (context shorter than it: nothing freed yet) and ``past`` it, the latter only for
    prompts whose tokens agree inside. Each: the positions compared, how many moved past each of STEPS
    (``over``), the largest |Δ|, and the (prompt, position) of each first different token."""
    out = {w: {"positions": 0, "over": dict.fromkeys(map(str, STEPS), 0), "max_dlogprob": 0.0, "diverging": []}
           for w in ("inside", "past")}
    for i, (d, a, n) in enumerate(zip(dec, alone, lengths)):
        inside = max(0, window - n)
        for k, (x, y) in enumerate(zip(d.token_ids, a.token_ids)):
            where = out["inside" if k < inside else "past"]
            if x != y:
                where["diverging"].append([i, k])
                break
            dl = abs(d.logprobs[k][x].logprob - a.logprobs[k][x].logprob)
            where["positions"] += 1
            where["over"] = {s: n + (dl > float(s)) for s, n in where["over"].items()}
            where["max_dlogprob"] = max(where["max_dlogprob"], dl)
    return out
