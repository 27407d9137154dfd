"""Teacher-forced scores from vLLM that read the context back from the KV cache, as decode does.

vLLM computes a prompt in one prefill when it fits one step, and some backends attend a request's first prefill
on the unquantized K/V (turboquant, MLA): a score of a whole prompt at once never reads the cache. Two ways make
the continuation read its context from the cache:

- the prefix cache: each context less its last token is written first (a request of its own) and the scoring
  request reads it back (``skip_reading_prefix_cache=False``; vLLM skips the cache for prompt logprobs otherwise).
  The hit is whole blocks of the context.
- chunks, for the requests the prefix cache did not serve (prefix caching off: poison's engines and, in vLLM 0.24,
  every hybrid model by default; a context shorter than one block): they are scored together with the scheduler's
  ``long_prefill_token_threshold`` at ``CHUNK`` tokens, so each request is computed ``CHUNK`` tokens a step and each
  chunk attends the chunks before it as the cache holds them. vLLM does the same for an engine started with
  ``long_prefill_token_threshold=CHUNK``; only the running scheduler's threshold changes, for these requests only.

``context_from_cache`` of a score is the context tokens the first continuation token's logits read back: the
prefix-cache hit, or the tokens of the chunks before the one that computed the context's last token, as vLLM's
scheduler scheduled them (recorded, not assumed: vLLM 0.32 lets a request that runs alone take the whole budget).
"""

from __future__ import annotations

from contextlib import contextmanager

from kvdiag.engines.base import Scored
from kvdiag.engines.vllm import adapt

CHUNK = 16  # tokens a step when scoring in chunks (vLLM's default block size)


def score(llm, ctxs: list[list[int]], conts: list[list[int]], k: int) -> list[Scored]:
    """Scores of each non-empty continuation after its context (``k``: top logprobs kept per position)."""
    from vllm import SamplingParams

    one = dict(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    todo = [i for i, c in enumerate(conts) if c]
    outs, hits = {}, {}
    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching and todo:
        _write_contexts(llm, [ctxs[i] for i in todo])
        got = llm.generate([{"prompt_token_ids": ctxs[i] + conts[i]} for i in todo],
                           SamplingParams(**one, skip_reading_prefix_cache=False), use_tqdm=False)
        for i, out in zip(todo, got):
            hit = int(out.num_cached_tokens or 0)
            # no hit (a context shorter than a block), or one past the context (this continuation scored
            # before: some of its logits uncomputed): scored in chunks below
            if 0 < hit < len(ctxs[i]):
                outs[i], hits[i] = out, hit
    chunked = [i for i in todo if i not in outs]
    if chunked:
        with chunks(llm, CHUNK) as steps:
            got = llm.generate([{"prompt_token_ids": ctxs[i] + conts[i]} for i in chunked], SamplingParams(**one),
                               use_tqdm=False)
        for i, out in zip(chunked, got):
            outs[i], hits[i] = out, read_back(steps, out.request_id, len(ctxs[i]))
    results = [Scored(logprobs=[], is_greedy=True, top_logprobs=[] if k else None) for _ in conts]
    for i in todo:
        results[i] = adapt.scored(outs[i], len(ctxs[i]), conts[i], k, hits[i])
    return results


@contextmanager
def chunks(llm, tokens: int):
    """The running scheduler prefills each request at most ``tokens`` a step (its config's
    ``long_prefill_token_threshold``), then as before. Yields the steps it schedules meanwhile, ``[{scheduler request
    id: tokens}, ...]``, or None where this vLLM's scheduler is not in this process, or splits a hybrid's prefill at
    whole blocks (a Mamba state cached per block, prefix caching on: it would never schedule a smaller chunk of a
    prompt longer than a block); the requests then run unchunked."""
    from kvdiag.engines.vllm.kv import KVAccessError, engine_core

    try:
        sched = engine_core(llm).scheduler
    except KVAccessError:
        sched = None
    config = getattr(sched, "scheduler_config", None)
    before = getattr(config, "long_prefill_token_threshold", None)
    if not isinstance(before, int) or getattr(sched, "need_mamba_block_aligned_split", False):
        yield None
        return
    steps, schedule = [], sched.schedule

    def recorded(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append(dict(out.num_scheduled_tokens))
        return out

    config.long_prefill_token_threshold = min(before, tokens) if before > 0 else tokens
    sched.schedule = recorded
    try:
        yield steps
    finally:
        config.long_prefill_token_threshold = before
        sched.schedule = schedule


def read_back(steps: list[dict] | None, request_id: str, n_ctx: int) -> int:
    """The tokens before the chunk of ``request_id`` that computed its position ``n_ctx - 1`` (0 when unrecorded).
    vLLM's scheduler knows a request by the caller's id with a suffix (``{id}-{8 hex}`` in vLLM 0.24 and 0.32)."""
    done = 0
    for step in steps or []:
        n = next((v for k, v in step.items() if k == request_id or k.rsplit("-", 1)[0] == request_id), 0)
        if done + n >= n_ctx:
            return done
        done += n
    return 0


def _write_contexts(llm, ctxs: list[list[int]]) -> None:
    """Prefill each distinct context less its last token into the prefix cache (so that a cache hit always leaves
    the first continuation token's logits to compute)."""
    from vllm import SamplingParams

    heads = list(dict.fromkeys(tuple(c[:-1]) for c in ctxs if len(c) > 1))
    if heads:
        llm.generate([{"prompt_token_ids": list(h)} for h in heads],
                     SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
