"""Scores read through the KV cache: vLLM's prompt logprobs placed after a prefix-cache hit, and the drift's
warning when a quantized dtype's scores did not read the cache (no GPU, no vLLM: fakes of vLLM's outputs in the
two layouts its model runners return; tests/integration/test_vllm_engine.py and tests/gpu/test_vllm_score.py run
the real one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvdiag.checks.sweep import drift
from kvdiag.engines.vllm import adapt


def row(token: int, lp: float) -> dict:
    return {token: SimpleNamespace(logprob=lp, rank=1)}


def output(n_ctx: int, cont: list[int], hit: int, *, runner: str) -> SimpleNamespace:
    """Prompt logprobs of context + continuation as vLLM returns them after a hit of ``hit`` tokens: the V1 runner
    a full-length list whose rows before the hit are unset, model runner V2 only the computed rows."""
    real = [None] + [row(7, -0.5)] * (n_ctx - 1) + [row(t, -float(j + 1)) for j, t in enumerate(cont)]
    if runner == "v1":
        rows = [None] + [row(-1, 1e30)] * hit + real[hit + 1:] if hit else real
    else:
        rows = [None] + real[hit + 1:]
    return SimpleNamespace(prompt_logprobs=rows, num_cached_tokens=hit)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("hit", [0, 16, 32])
def test_the_continuation_is_found_after_any_hit_in_either_runner_s_layout(runner, hit):
    s = adapt.scored(output(40, [3, 4, 5], hit, runner=runner), 40, [3, 4, 5], 0, hit)
    assert s.logprobs == [-1.0, -2.0, -3.0] and s.context_from_cache == hit


def test_a_hit_into_the_continuation_is_refused_not_misread():
    with pytest.raises(RuntimeError, match="cannot place the continuation"):
        adapt.scored(output(40, [3, 4, 5], 40, runner="v2"), 40, [3, 4, 5], 0, 40)


def drift_of(share):
    return {"by_position": {}, "context_from_cache": share}


def test_a_quantized_dtype_scored_mostly_without_the_cache_is_warned_about():
    fp8 = drift.limits_for("fp8", "bfloat16")
    (kind, msg, evidence), = drift.warnings(drift_of(0.25), fp8)
    assert kind == "drift_uncached" and "for 25% of the prompts" in msg and evidence == {"context_from_cache": 0.25}
    assert drift.warnings(drift_of(0.0), fp8)[0][0] == "drift_uncached"  # a hybrid model on vLLM: blocks of 512
    assert drift.warnings(drift_of(drift.MIN_FROM_CACHE), fp8) == []  # e.g. 7 of 8: one context under a block
    assert drift.warnings(drift_of(None), fp8) == []  # an engine that does not say (the builtin)
    assert drift.warnings(drift_of(0.0), drift.limits_for("bfloat16", "bfloat16")) == []  # nothing to quantize


def test_the_share_counts_prompts_whose_context_came_from_the_cache():
    assert drift.from_cache({"from_cache": [0, 16, 32, None]}) == pytest.approx(2 / 3)
    assert drift.from_cache({"from_cache": [None, None]}) is None
    assert drift.from_cache({}) is None


class FakeScheduler:
    """vLLM's scheduler as scoring.py sees it: each step gives each queued request in turn its tokens left, at most
    its config's ``long_prefill_token_threshold`` and what is left of the step's ``max_num_batched_tokens``; its
    request ids are the caller's with a suffix. Its output says where each request's tokens start (new requests and
    cached ones, as vLLM's). ``preempt``: request number -> the tokens after which that request is preempted once
    (its computed tokens dropped, not scheduled that step, then computed from the start); ``alone``: a request left
    alone takes the whole budget (vLLM 0.32)."""

    def __init__(self, budget: int = 8192, preempt: dict[int, int] | None = None, alone: bool = False):
        self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=0, max_num_batched_tokens=budget)
        self.left: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.preempt, self.alone = {f"{k}-0a1b2c3d": v for k, v in (preempt or {}).items()}, alone

    def schedule(self):
        out = {r for r, at in self.preempt.items() if self.done.get(r, 0) >= at}
        for r in out:  # its tokens to compute again, from the next step on
            del self.preempt[r]
            self.left[r], self.done[r] = self.left[r] + self.done[r], 0
        cap = self.scheduler_config.long_prefill_token_threshold or 1 << 30
        if self.alone and sum(1 for n in self.left.values() if n) == 1:
            cap = 1 << 30
        budget, step, new, cached = self.scheduler_config.max_num_batched_tokens, {}, [], {}
        for r, n in self.left.items():
            if n and budget and r not in out:
                step[r] = min(cap, n, budget)
                budget -= step[r]
                if r in self.done:
                    cached[r] = self.done[r]
                else:
                    new.append(SimpleNamespace(req_id=r, num_computed_tokens=0))
                self.left[r] -= step[r]
                self.done[r] = self.done.get(r, 0) + step[r]
        return SimpleNamespace(num_scheduled_tokens=step, scheduled_new_reqs=new, scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), num_computed_tokens=list(cached.values())))


class FakeLLM:
    """vLLM's ``LLM`` as scoring.py drives it: a prefix cache of 32-token blocks (when on), a scheduler that
    computes each prompt's tokens, and a record of each ``generate`` call: (prompts, threshold, prompt logprobs);
    prompt logprobs of -1, -2, ... after any hit."""

    def __init__(self, prefix_caching: bool, in_process: bool = True, budget: int = 8192, **sched):
        self.sched = FakeScheduler(budget, **sched)
        core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=self.sched)) if in_process else None
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
            cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, block_size=32)), engine_core=core)
        self.written, self.calls, self.ids = set(), [], 0

    def generate(self, prompts, sp, use_tqdm=False):
        config = self.sched.scheduler_config
        self.calls.append((len(prompts), config.long_prefill_token_threshold, sp.get("prompt_logprobs") is not None))
        outs = []
        for p in prompts:
            ids, self.ids = p["prompt_token_ids"], self.ids + 1
            if sp.get("prompt_logprobs") is None:  # a context written to the prefix cache
                self.written.add(tuple(ids))
                outs.append(None)
                continue
            reads = sp.get("skip_reading_prefix_cache") is False
            hit = max((len(h) // 32 * 32 for h in self.written if reads and tuple(ids[:len(h)]) == h), default=0)
            self.sched.left[f"{self.ids}-0a1b2c3d"] = len(ids) - hit
            outs.append(SimpleNamespace(prompt_logprobs=[None] + [row(t, -float(j + 1)) for j, t in enumerate(ids[1:])],
                                        num_cached_tokens=hit, request_id=str(self.ids)))
        while any(self.sched.left.values()):
            self.sched.schedule()
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=dict))


def test_with_prefix_caching_off_the_requests_are_scored_in_chunks_that_read_the_ones_before(fake_vllm):
    from kvdiag.engines.vllm import scoring

    llm = FakeLLM(prefix_caching=False)
    ctxs, conts = [list(range(40)), list(range(10)), list(range(5))], [[3, 4], [5], []]
    got = scoring.score(llm, ctxs, conts, 0)
    assert llm.calls == [(2, scoring.CHUNK, True)]  # no prefix pass; one batch, 16 tokens a step each
    assert llm.sched.scheduler_config.long_prefill_token_threshold == 0  # the engine's own again
    assert llm.sched.schedule.__func__ is FakeScheduler.schedule  # the recording stopped
    assert [s.context_from_cache for s in got] == [32, 0, None]  # the 40th token's chunk starts at 32
    assert got[0].logprobs == [-40.0, -41.0] and got[2].logprobs == []


def test_with_prefix_caching_on_only_a_context_the_cache_did_not_serve_is_scored_in_chunks(fake_vllm):
    from kvdiag.engines.vllm import scoring

    llm = FakeLLM(prefix_caching=True)
    got = scoring.score(llm, [list(range(40)), list(range(20))], [[3, 4], [5]], 0)
    # the context that can hit written and scored reading the prefix cache; the one whose 19 tokens would fill no
    # block goes straight to chunks (not computed twice)
    assert llm.calls == [(1, 0, False), (1, 0, True), (1, scoring.CHUNK, True)]
    assert [s.context_from_cache for s in got] == [32, 16]


def test_a_threshold_of_the_users_own_is_kept_when_smaller_and_restored(fake_vllm):
    from kvdiag.engines.vllm import scoring

    llm = FakeLLM(prefix_caching=False)
    llm.sched.scheduler_config.long_prefill_token_threshold = 8  # -a long_prefill_token_threshold=8
    (s,) = scoring.score(llm, [list(range(44))], [[3]], 0)
    assert llm.calls == [(1, 8, True)] and s.context_from_cache == 40
    assert llm.sched.scheduler_config.long_prefill_token_threshold == 8


@pytest.mark.parametrize("why", ["out of reach", "Mamba splits at whole blocks"])
def test_a_scheduler_that_cannot_chunk_scores_in_one_prefill_and_says_it_read_nothing_back(fake_vllm, why):
    from kvdiag.engines.vllm import scoring

    llm = FakeLLM(prefix_caching=False, in_process=why != "out of reach")
    llm.sched.need_mamba_block_aligned_split = why != "out of reach"  # vLLM would never schedule a 16-token chunk
    (s,) = scoring.score(llm, [list(range(40))], [[3]], 0)
    assert llm.calls == [(1, 0, True)]  # the threshold untouched
    assert s.context_from_cache == 0 and s.logprobs == [-40.0]


def test_what_was_read_back_is_what_the_scheduler_scheduled_not_what_was_asked():
    from kvdiag.engines.vllm import scoring

    steps = scoring.Steps([{"7-0a1b2c3d": (0, 16), "8-0a1b2c3d": (0, 16), "70-0a1b2c3d": (0, 5)},
                           {"7-0a1b2c3d": (16, 16)}, {"7-0a1b2c3d": (32, 100)}])  # left alone: all of it
    seen = steps.take(["7", "8", "9"])
    assert seen == {"7": [(0, 16), (16, 16), (32, 100)], "8": [(0, 16)], "9": []} and steps == []
    assert scoring.read_back(seen["7"], 50) == 32 and scoring.read_back(seen["7"], 33) == 32
    assert scoring.read_back(seen["7"], 32) == 16 and scoring.read_back(seen["8"], 10) == 0
    assert scoring.read_back([], 50) == 0
    # a vLLM that does not say where a chunk starts: the chunks before it
    assert scoring.read_back([(None, 16), (None, 16), (None, 100)], 50) == 32
    # preempted after two chunks, then computed again in one: nothing read back
    assert scoring.read_back([(0, 16), (16, 16), (0, 132)], 50) == 0


def test_a_request_preempted_and_computed_again_counts_its_last_run(fake_vllm):
    """vLLM preempts a request when its KV blocks run out, drops what it computed and computes it again; a request
    left alone then (vLLM 0.32) takes the whole budget: its context is computed in one and read nothing back."""
    from kvdiag.engines.vllm import scoring

    llm = FakeLLM(prefix_caching=False, preempt={1: 32}, alone=True)  # the 300-token context, after 2 chunks
    got = scoring.score(llm, [list(range(300)), list(range(40))], [[1], [2]], 0)
    assert llm.calls == [(2, 16, True)]
    assert [s.context_from_cache for s in got] == [0, 32]
    unpreempted = FakeLLM(prefix_caching=False, alone=True)
    assert [s.context_from_cache for s in scoring.score(unpreempted, [list(range(300)), list(range(40))],
                                                        [[1], [2]], 0)] == [48, 32]  # 3 chunks, then alone


def test_the_chunk_is_a_power_of_two_of_about_an_eighth_of_the_shortest_context():
    from kvdiag.engines.vllm import scoring

    assert [scoring.chunk_tokens(n) for n in (1, 100, 256, 300, 1800, 2048)] == [16, 16, 32, 32, 128, 256]
    for n in range(16 * scoring.READ_BACK, 10000):
        t = scoring.chunk_tokens(n)
        assert t & (t - 1) == 0 and n / 16 < t <= n / 8  # reads back 7/8 or more, in 8 to 16 chunks


def test_no_more_requests_go_at_once_than_the_budget_computes_whole_chunks_of_and_none_alone(fake_vllm):
    from kvdiag.engines.vllm import scoring

    llm = FakeLLM(prefix_caching=False, budget=72)  # 4 chunks of 16, and 8 tokens left over
    ctxs = [list(range(300))] * 2 + [list(range(130))] * 3  # the shortest: chunks of 16
    got = scoring.score(llm, ctxs, [[1]] * 5, 0)
    assert llm.calls == [(3, 16, True), (2, 16, True)]  # 3 + 2, not 4 + 1 (vLLM 0.32 unchunks a request alone)
    # every chunk whole: the context's last token in the chunk at (n - 1) // 16 * 16
    assert [s.context_from_cache for s in got] == [288] * 2 + [128] * 3
    assert llm.sched.scheduler_config.long_prefill_token_threshold == 0
