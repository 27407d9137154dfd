"""The builtin engine's KV paths (prefix caching, preemption by recompute, chunked prefill, a KV connector between
two engines) against its cold path.

The oracle is the same engine with every path off (no prefix cache, a pool that holds every request at its longest,
each prompt prefilled whole), and for one run of every path transformers' float64 forward. Each path fault must
change the output of its own path and of no other.
"""

import os
import shutil
import tempfile

import pytest
import torch

from kvdiag.assets import TINY_MODEL
from kvdiag.engines.base import EngineSpec
from kvdiag.engines.builtin.block_manager import BlockManager
from kvdiag.engines.builtin.engine import BuiltinEngine
from kvdiag.engines.builtin.faults import PATH_FAULTS
from kvdiag.errors import UserError

DEV = os.environ.get("KVDIAG_TEST_DEVICE", "cpu")
BS, N = 8, 12  # block size; tokens generated
PROMPTS = ["The cache holds keys and values of every layer", "Blocks of sixteen tokens each, hashed as a chain",
           "short one", "Another prompt that is long enough to fill blocks"]  # 47, 49, 10, 50 tokens with BOS
ATOL = 1e-4  # float32 batch-composition noise is ~1e-6
# each path, as the engine args and pool that take it; "prefix" runs twice (the second run hits); "evicted" runs
# prompts 0, 1 and 3 alone first in a pool that holds one request at its longest (1 and 3 evict what 0 left cached,
# the last run reads none of its blocks from the cache: only the stale hashes of a fault would hit)
PATHS = {"cold": ({}, None, 64), "prefix": ({}, True, 64), "preemption": ({"preemption": 1}, None, 14),
         "chunked": ({"enable_chunked_prefill": 1, "max_num_batched_tokens": 10}, None, 64),
         "evicted": ({}, True, 9), "connector": ({}, None, 64)}
BREAKS = {"prefix_hit_treated_fresh": ("prefix",), "preempt_keeps_freed_blocks": ("preemption",),
          "chunk_context_dropped": ("chunked",), "evicted_block_keeps_hash": ("evicted",),
          "connector_load_layer_shifted": ("connector",)}


def _start(args=None, prefix_caching=None, num_blocks=64, faults=(), e=None, **kw):
    e = e or BuiltinEngine()
    e.start(EngineSpec(model=str(TINY_MODEL), device=DEV, dtype="float32", block_size=BS, num_blocks=num_blocks,
                       prefix_caching=prefix_caching, faults=faults,
                       engine_args={"ignore_eos": True, **(args or {})}, **kw))
    return e


def _run(e, prompts=PROMPTS, **kw):
    kw.setdefault("greedy", True)
    return [(c.token_ids, c.logprobs) for c in e.generate(prompts, N, **kw)]


def _diff(a, b) -> float:
    """Largest logprob difference; inf where any token differs."""
    if [x for x, _ in a] != [y for y, _ in b]:
        return float("inf")
    return max(abs(p - q) for (_, x), (_, y) in zip(a, b) for p, q in zip(x, y))


def _path(name, faults=(), e=None, prompts=PROMPTS, **kw):
    args, prefix, blocks = PATHS[name]
    if name == "connector":  # another engine saves the prompts' blocks; this one loads them
        args = {"kv_connector_dir": tempfile.mkdtemp(prefix="kvdiag-test-connector-")}
        _run(_start(args, prefix, blocks, faults), prompts, **kw)
    e = _start(args, prefix, blocks, faults, e=e)
    for i in (0, 1, 3) if name == "evicted" else ():
        _run(e, [prompts[i]], **kw)
    out = _run(e, prompts, **kw)
    if name == "prefix":
        out = _run(e, prompts, **kw)
    if name == "connector":
        shutil.rmtree(args["kv_connector_dir"])
    return out, e


@pytest.fixture(scope="module")
def cold():
    e = _start()
    out = {"greedy": _run(e), "seeded": _run(e, greedy=False, seed=11)}
    e.shutdown()
    return out


def _cold_of(e, prompts):
    return _run(_start(e=e), prompts)


def test_no_switch_takes_no_path_and_counts_nothing(cold):
    e = _start(prefix_caching=False)
    assert _run(e) == cold["greedy"]  # bit-identical: the same steps as before the paths existed
    counters = e.path_counters()
    if DEV == "cpu":
        assert set(counters) == {"prefix_hit_tokens", "evicted_blocks", "preemptions", "prefill_chunks",
                                 "cuda_graph_replays", "connector_loaded_tokens"}
        assert not any(counters.values())
    assert not any(counters[k] for k in ("prefix_hit_tokens", "preemptions", "prefill_chunks"))
    assert e.fault_fired == dict.fromkeys(PATH_FAULTS, 0) and not e.blocks.hash_of
    e.shutdown()


def test_prefix_cache_hits_full_blocks_and_gives_the_cold_output(cold):
    e = _start(prefix_caching=True)
    assert _diff(_run(e), cold["greedy"]) <= ATOL and e.path_counters()["prefix_hit_tokens"] == 0
    assert _diff(_run(e), cold["greedy"]) <= ATOL
    lens = [len(e.encode(p)) for p in PROMPTS]
    assert e.path_counters()["prefix_hit_tokens"] == sum((n - 1) // BS * BS for n in lens)  # the last token computed
    # a prompt sharing the first 21 tokens (2 full blocks and 5 tokens of the third) of a cached one
    shared = e.encode(PROMPTS[0])[:21] + e.encode("! Then something else")[1:]
    before = e.path_counters()["prefix_hit_tokens"]
    got = _run(e, [shared])
    assert e.path_counters()["prefix_hit_tokens"] - before == 16
    assert _diff(got, _cold_of(BuiltinEngine(), [shared])) <= ATOL
    assert e.reset_prefix_cache() and not e.blocks.hash_of
    before = e.path_counters()["prefix_hit_tokens"]
    assert _diff(_run(e), cold["greedy"]) <= ATOL and e.path_counters()["prefix_hit_tokens"] == before
    assert e.blocks.num_free == e.kv.num_blocks == len(e.kv_blocks().free_blocks())  # cached blocks count as free
    _start(prefix_caching=True, e=e)
    assert e.path_counters()["prefix_hit_tokens"] == 0  # start resets the counters
    e.shutdown()


def test_prefix_cache_eviction_reuses_blocks_and_keeps_the_cold_output(cold):
    e = _start(prefix_caching=True, num_blocks=9)  # one request at its longest takes 8
    hits = []
    for i in (0, 1, 3, 0, 0, 2):  # 1 and 3 evict what 0 left cached; 0 right after 0 hits
        before = e.path_counters()["prefix_hit_tokens"]
        assert _diff(_run(e, [PROMPTS[i]]), [cold["greedy"][i]]) <= ATOL
        hits.append(e.path_counters()["prefix_hit_tokens"] - before)
    full = (len(e.encode(PROMPTS[0])) - 1) // BS * BS
    assert hits[3] < full and hits[4] == full and e.path_counters()["evicted_blocks"] > 0
    assert _diff(_run(e), cold["greedy"]) <= ATOL  # all four at once, waiting for blocks
    e.shutdown()


def test_block_manager_prefix_cache_lru_and_reset():
    fresh = []
    bm = BlockManager(4, 2, fresh.append)
    a = bm.grow([], 4)  # [0, 1]
    bm.grow([], 2)  # [2], held throughout
    bm.cache(a, [b"h0", b"h1"])
    assert bm.match([b"h0", b"h1", b"h2"]) == [0, 1] and bm.match([b"h2", b"h1"]) == []
    assert not bm.reset_cache()  # a sequence still holds a cached block
    bm.free(a)  # last block first: 1 is evicted before 0
    assert bm.num_free == 3 and bm.free_blocks() == [0, 1, 3] and list(bm.evictable) == [1, 0]
    assert bm.allocate(1) == [3]  # plain free blocks first
    fresh.clear()
    assert bm.allocate(1) == [1] and fresh == [[1]] and bm.match([b"h0", b"h1"]) == [0]  # evicted, zeroed
    assert bm.take([0]) == [0] and bm.refs[0] == 1 and not bm.evictable and fresh == [[1]]  # a hit: not zeroed
    bm.free([0])
    assert bm.reset_cache() and bm.match([b"h0"]) == [] and bm.free_blocks() == [0]


def test_preemption_recomputes_and_gives_the_cold_output(cold):
    e = _start({"preemption": 1}, num_blocks=14)  # four requests at their longest need 26 blocks
    assert _diff(_run(e), cold["greedy"]) <= ATOL and e.path_counters()["preemptions"] > 0
    prompts = {tuple(e.encode(p)) for p in PROMPTS}  # each preemption's point: a prompt of the run, part-way
    assert len(e.preempted_at()) == e.path_counters()["preemptions"]
    assert all(p in prompts and 0 < k < N for p, k in e.preempted_at()), e.preempted_at()
    assert _diff(_run(e, greedy=False, seed=11), cold["seeded"]) <= ATOL  # each request's generator goes on
    assert e.blocks.num_free == 14
    _start({"preemption": 1}, prefix_caching=True, num_blocks=14, e=e)
    assert _diff(_run(e), cold["greedy"]) <= ATOL and _diff(_run(e), cold["greedy"]) <= ATOL
    assert e.path_counters()["preemptions"] > 0 and e.path_counters()["prefix_hit_tokens"] > 0
    _start(num_blocks=14, e=e)  # default admission reserves whole lengths: requests wait, none is preempted
    assert _diff(_run(e), cold["greedy"]) <= ATOL and e.path_counters()["preemptions"] == 0
    _start({"preemption": 1}, num_blocks=6, e=e)
    with pytest.raises(UserError, match="KV blocks"):  # alone it does not fit: no preemption helps
        e.generate([PROMPTS[0]], N)
    e.shutdown()


def test_chunked_prefill_gives_the_cold_output(cold):
    e = _start({"enable_chunked_prefill": 1, "max_num_batched_tokens": 10})
    assert _diff(_run(e), cold["greedy"]) <= ATOL
    lens = [len(e.encode(p)) for p in PROMPTS]
    assert e.path_counters()["prefill_chunks"] >= sum(-(-n // 10) for n in lens if n > 10)  # each entry counts
    _start({"max_num_batched_tokens": 10}, e=e)  # without enable_chunked_prefill the budget is raised: no chunk
    assert _run(e) == cold["greedy"] and e.path_counters()["prefill_chunks"] == 0
    e.shutdown()


def test_kv_connector_loads_what_another_engine_saved_and_gives_the_cold_output(cold, tmp_path):
    """A second engine loads each prompt's full blocks from the files the first saved (its counter: those tokens),
    prefills only the rest and gives the cold output; the saving engine loads nothing and saves once per prompt; a
    prompt of another kv dtype's store is not read as this one's (the case's store is its own directory)."""
    args = {"kv_connector_dir": str(tmp_path)}
    saver = _start(args)
    assert _diff(_run(saver), cold["greedy"]) <= ATOL and saver.path_counters()["connector_loaded_tokens"] == 0
    lens = [len(saver.encode(p)) for p in PROMPTS]
    assert len(list(tmp_path.iterdir())) == sum((n - 1) // BS > 0 for n in lens)  # one file per prompt of a block
    loader = _start(args)
    assert _diff(_run(loader), cold["greedy"]) <= ATOL
    assert loader.path_counters()["connector_loaded_tokens"] == sum((n - 1) // BS * BS for n in lens)
    assert loader.path_counters()["prefix_hit_tokens"] == 0
    _start(args, prefix_caching=True, e=loader)  # a prefix-cache hit first, the connector's blocks past it
    assert _diff(_run(loader), cold["greedy"]) <= ATOL and _diff(_run(loader), cold["greedy"]) <= ATOL
    assert loader.path_counters()["prefix_hit_tokens"] == loader.path_counters()["connector_loaded_tokens"]
    saver.shutdown()
    loader.shutdown()


@pytest.mark.parametrize("fault", PATH_FAULTS)
def test_each_path_fault_breaks_its_path_only(cold, fault):
    e = BuiltinEngine()
    for name in PATHS:
        out, e = _path(name, (fault,), e)
        broken = _diff(out, cold["greedy"]) > 1e-2
        assert broken == (name in BREAKS[fault]), (fault, name)
        assert bool(e.fault_fired[fault]) == (name in BREAKS[fault]), (fault, name)
        assert not any(n for f, n in e.fault_fired.items() if f != fault)
    e.shutdown()


def test_every_path_agrees_with_float64_transformers():
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float64).eval()
    e = BuiltinEngine()
    for name in ("prefix", "preemption", "chunked"):
        out, e = _path(name, e=e)
        for prompt, (tokens, logprobs) in zip(PROMPTS, out):
            ids = e.encode(prompt)
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([ids + tokens[:-1]])).logits[0], -1)[len(ids) - 1:]
            assert logprobs == pytest.approx(lp[range(N), tokens].tolist(), abs=ATOL), name
            top2 = lp.topk(2).values
            assert all(lp[i, t] == top2[i, 0] or top2[i, 0] - top2[i, 1] < ATOL for i, t in enumerate(tokens))
    e.shutdown()


def test_score_is_unchanged_with_prefix_caching_on(cold):
    contexts, continuations = PROMPTS[:3], [" and more", " x", " of the cache"]
    e = _start(num_blocks=16)
    plain = e.score(contexts, continuations, top_k=2)
    e.shutdown()
    e = _start(prefix_caching=True, num_blocks=16)
    _run(e)  # leaves cached blocks that score's allocations evict
    assert e.blocks.hash_of
    for a, b in zip(plain, e.score(contexts, continuations, top_k=2)):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6) and a.is_greedy == b.is_greedy
    e.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_preemption_is_held_to_a_recompute_at_its_own_points(tmp_path):
    """On a GPU in bf16 the builtin engine's cold path gave the same bits in every batch layout, yet its preemption
    moved one request's logprobs by 0.017 from the point it was preempted at: its recompute, a prefill of 145 tokens,
    which no cut of the floor's recomputes had (docs/vllm-gpu-results.md). kvdiag's preemption case
    measures a recompute at the points the engine preempted: the clean engine passes, with the probe's difference
    in its floor, and the fault that resumes on freed blocks is still caught."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    probe = subprocess.run([sys.executable, "tests/support/builtin_preempt_probe.py", "--device", "cuda"], cwd=root,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    truth = json.loads(probe.stdout.splitlines()[-1])["preemption"]
    out = subprocess.run([sys.executable, "-m", "kvdiag", "paths", "--device", "cuda", "-d", "auto", "-p",
                          "preemption", "-f", "json", "-q", "-o", str(tmp_path / "r")], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (case,) = [c for c in json.loads(out.stdout)["cases"] if c["params"]["path"] == "preemption"]
    m = case["metrics"]
    assert m["max_dlogprob"] == pytest.approx(truth["max_dlogprob"], abs=1e-6)  # the same engine, the same run
    assert sorted(map(tuple, m["preempted_at"])) == sorted(map(tuple, truth["preempted"]))
    assert m["floor"]["max_dlogprob"] >= truth["max_dlogprob"] or truth["max_dlogprob"] == 0, m
    caught = subprocess.run([sys.executable, "-m", "kvdiag", "selftest", "--device", "cuda", "-c", "paths", "--fault",
                             "preempt_keeps_freed_blocks", "-q", "-o", str(tmp_path / "s")], cwd=root,
                            capture_output=True, text=True, timeout=600)
    assert caught.returncode == 0, caught.stdout[-2000:]
