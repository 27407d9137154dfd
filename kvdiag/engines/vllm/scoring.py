"""Teacher-forced scores from vLLM that read the context back from the KV cache, as decode does.

vLLM computes a prompt in one prefill when it fits one step, and some backends attend a request's first prefill
on the unquantized K/V (turboquant, MLA): a score of a whole prompt at once never reads the cache. Two ways make
the continuation read its context from the cache:

- the prefix cache: each context less its last token is written first (a request of its own) and the scoring
  request reads it back (``skip_reading_prefix_cache=False``; vLLM skips the cache for prompt logprobs otherwise).
  The hit is whole blocks of the context.
- chunks, for the requests the prefix cache did not serve (prefix caching off: poison's engines and, in vLLM 0.24,
  every hybrid model by default; a context shorter than one block): they are scored together with the running
  scheduler's ``long_prefill_token_threshold`` at ``chunk_tokens`` (a power of two of about an eighth of the
  shortest context), so each request is computed a chunk a step and each chunk attends the chunks before it as the
  cache holds them. vLLM does the same for an engine started with that ``long_prefill_token_threshold``. No more go
  at once than the step budget computes whole chunks of, so no request's chunk is cut short by the others'. Only
  the running scheduler's threshold changes, for these requests only.

``context_from_cache`` of a score is the context tokens the first continuation token's logits read back: the
prefix-cache hit, or where the chunk that computed the context's last token started, as vLLM's scheduler scheduled
it (recorded, not assumed: vLLM 0.32 lets a request that runs alone take the whole budget; a request preempted and
computed again counts its last run).
"""

from __future__ import annotations

from contextlib import contextmanager

from kvdiag.engines.protocol import Scored
from kvdiag.engines.vllm import adapt

CHUNK = 16  # the fewest tokens a step of a request scored in chunks (vLLM's default block size)
READ_BACK = 8  # a chunk is at most 1/READ_BACK of the shortest context (of 8 chunks or more): 7/8 read back


def score(llm, ctxs: list[list[int]], conts: list[list[int]], k: int, finished=None) -> list[Scored]:
    """Scores of each non-empty continuation after its context (``k``: top logprobs kept per position).
    ``finished``: a ``progress.Finished`` count of the requests scored, as they are."""
    from vllm import SamplingParams

    bar = finished.bar if finished is not None else False
    one = dict(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    todo = [i for i, c in enumerate(conts) if c]
    outs, hits = {}, {}
    config = llm.llm_engine.vllm_config.cache_config
    block = getattr(config, "block_size", None) or 1
    can_hit = [i for i in todo if len(ctxs[i]) > block] if config.enable_prefix_caching else []
    if can_hit:  # (a context less its last token shorter than a block cannot hit)
        _write_contexts(llm, [ctxs[i] for i in can_hit])
        got = llm.generate([{"prompt_token_ids": ctxs[i] + conts[i]} for i in can_hit],
                           SamplingParams(**one, skip_reading_prefix_cache=False), use_tqdm=bar)
        for i, out in zip(can_hit, got):
            hit = int(out.num_cached_tokens or 0)
            # no hit, or one past the context (this continuation scored before: some of its logits uncomputed):
            # scored in chunks below
            if 0 < hit < len(ctxs[i]):
                outs[i], hits[i] = out, hit
    chunked = [i for i in todo if i not in outs]
    if finished is not None and can_hit:
        finished.set(len(outs))  # those without a hit are scored again below
    if chunked:
        with chunks(llm, chunk_tokens(min(len(ctxs[i]) for i in chunked))) as (steps, at_once):
            parts = -(-len(chunked) // at_once) if at_once else 1  # as even as can be: none left to run alone
            for part in (chunked[j::parts] for j in range(parts)):
                got = llm.generate([{"prompt_token_ids": ctxs[i] + conts[i]} for i in part], SamplingParams(**one),
                                   use_tqdm=bar)
                seen = steps.take([out.request_id for out in got])
                for i, out in zip(part, got):
                    outs[i], hits[i] = out, read_back(seen[out.request_id], len(ctxs[i]))
    results = [Scored(logprobs=[], is_greedy=True, top_logprobs=[] if k else None) for _ in conts]
    for i in todo:
        results[i] = adapt.scored(outs[i], len(ctxs[i]), conts[i], k, hits[i])
    return results


def chunk_tokens(shortest: int) -> int:
    """The chunk of requests whose shortest context is ``shortest`` tokens: the largest power of two at most
    ``shortest / READ_BACK``, at least CHUNK. Each reads back at least 7/8 of a context longer than 8 chunks, and the
    shortest takes 8 to 16 steps."""
    return max(CHUNK, 1 << (max(shortest // READ_BACK, 1).bit_length() - 1))


@contextmanager
def chunks(llm, tokens: int):
    """The running scheduler prefills each request at most ``tokens`` a step (its config's
    ``long_prefill_token_threshold``, or the user's own where smaller), then as before. Yields ``(steps, at_once)``:
    the steps it schedules meanwhile (``Steps``), and how many requests to send at once (the step budget's whole
    chunks: no request's chunk is cut short by the others'; ``None``: all). No steps are recorded where this vLLM's
    scheduler is not in this process, or splits a hybrid's prefill at whole blocks (a Mamba state cached per block,
    prefix caching on: it would never schedule a smaller chunk of a prompt longer than a block); the requests then
    run unchunked, all at once."""
    from kvdiag.engines.vllm.kv import KVAccessError, engine_core

    try:
        sched = engine_core(llm).scheduler
    except KVAccessError:
        sched = None
    config = getattr(sched, "scheduler_config", None)
    before = getattr(config, "long_prefill_token_threshold", None)
    steps = Steps()
    if not isinstance(before, int) or getattr(sched, "need_mamba_block_aligned_split", False):
        yield steps, None
        return
    schedule = sched.schedule

    def recorded(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append(scheduled(out))
        return out

    tokens = min(before, tokens) if before > 0 else tokens
    config.long_prefill_token_threshold, sched.schedule = tokens, recorded
    try:
        budget = getattr(config, "max_num_batched_tokens", 0) or 0
        yield steps, max(1, budget // tokens) if budget else None
    finally:
        config.long_prefill_token_threshold, sched.schedule = before, schedule


def scheduled(out) -> dict[str, tuple[int | None, int]]:
    """Each request of one step's ``SchedulerOutput``: (its tokens computed before this step, its tokens in this
    step); the first ``None`` where this vLLM does not say."""
    start = {r.req_id: r.num_computed_tokens for r in getattr(out, "scheduled_new_reqs", None) or ()}
    cached = getattr(out, "scheduled_cached_reqs", None)
    start.update(zip(getattr(cached, "req_ids", ()), getattr(cached, "num_computed_tokens", ())))
    return {r: (start.get(r), n) for r, n in out.num_scheduled_tokens.items()}


class Steps(list):
    """The steps vLLM's scheduler scheduled, ``[{scheduler request id: (start, tokens)}, ...]`` (``scheduled``)."""

    def take(self, ids: list[str]) -> dict[str, list[tuple[int | None, int]]]:
        """The chunks (start, tokens) of each of the caller's request ``ids``, step by step; the steps are forgotten.
        vLLM's scheduler knows a request by the caller's id with a suffix (``{id}-{8 hex}`` in vLLM 0.24 and 0.32)."""
        out: dict[str, list[tuple[int | None, int]]] = {i: [] for i in ids}
        for step in self:
            for key, chunk in step.items():
                out.get(key if key in out else key.rsplit("-", 1)[0], []).append(chunk)
        self.clear()
        return out


def read_back(chunks: list[tuple[int | None, int]], n_ctx: int) -> int:
    """Where the last chunk that computed position ``n_ctx - 1`` of a request started: the tokens it read back
    (0 when unrecorded, or computed in one). A chunk's start is the scheduler's where it said it, else the tokens of
    the chunks before it; a request preempted and computed again starts again."""
    done = last = 0
    for start, n in chunks:
        done = done if start is None else start
        if done < n_ctx <= done + n:
            last = done
        done += n
    return last


def _write_contexts(llm, ctxs: list[list[int]]) -> None:
    """Prefill each distinct context less its last token into the prefix cache (so that a cache hit always leaves
    the first continuation token's logits to compute)."""
    from vllm import SamplingParams

    heads = list(dict.fromkeys(tuple(c[:-1]) for c in ctxs if len(c) > 1))
    if heads:
        llm.generate([{"prompt_token_ids": list(h)} for h in heads],
                     SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
