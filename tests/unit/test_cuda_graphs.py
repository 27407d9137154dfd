"""The builtin engine's decode CUDA graphs (kvdiag/engines/builtin/cuda_graph.py): replays give the tokens and
logprobs of eager steps, graphs are dropped at sleep / kv dtype switch / shutdown and re-captured after wake,
their memory goes back at shutdown; off on CPU. The GPU tests run with KVDIAG_TEST_DEVICE=cuda."""

import os
from types import SimpleNamespace

import pytest
import torch

from kvdiag.engines.base import EngineSpec
from kvdiag.engines.builtin import cuda_graph
from kvdiag.engines.builtin.engine import BuiltinEngine

DEV = os.environ.get("KVDIAG_TEST_DEVICE", "cpu")
gpu = pytest.mark.skipif(DEV != "cuda" or not torch.cuda.is_available(), reason="needs KVDIAG_TEST_DEVICE=cuda")
# a 600-token prompt spans two 512-token attention splits; the graphs' tables are sized for 2048 tokens
PROMPTS = [[3 + i % 250 for i in range(600)], "The cache holds keys", "and values of every layer, block by block; ",
           "short"]


@pytest.fixture
def model(random_model):
    return random_model("llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, init_std=0.15)


def _start(path, graphs: bool, kv_dtype="auto"):
    e = BuiltinEngine()
    e.start(EngineSpec(model=path, device=DEV, dtype="bfloat16", block_size=16, num_blocks=256, max_model_len=2048,
                       kv_cache_dtype=kv_dtype, engine_args={"ignore_eos": True, "cuda_graphs": int(graphs)}))
    return e


def _runs(e):
    """Greedy tokens and logprobs at batch sizes 4, 1 and 3."""
    out = []
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[1:]):
        out += [(c.token_ids, c.logprobs) for c in e.generate(prompts, 12, greedy=True, logprobs=2)]
    return out


def test_enabled_switches():
    spec = SimpleNamespace(engine_args={})
    assert not cuda_graph.enabled(spec, torch.device("cpu"))
    assert cuda_graph.enabled(spec, torch.device("cuda"))
    for off in ("0", "false", "off", 0):
        assert not cuda_graph.enabled(SimpleNamespace(engine_args={"cuda_graphs": off}), torch.device("cuda"))
    os.environ[cuda_graph.ENV] = "0"
    try:
        assert not cuda_graph.enabled(spec, torch.device("cuda"))
        assert cuda_graph.enabled(SimpleNamespace(engine_args={"cuda_graphs": "1"}), torch.device("cuda"))
    finally:
        del os.environ[cuda_graph.ENV]


@pytest.mark.skipif(DEV != "cpu", reason="CPU behaviour")
def test_no_graphs_on_cpu(model):
    e = _start(model, graphs=True)
    try:
        assert e.generate(["short"], 3)[0].token_ids and e.graphs is None
    finally:
        e.shutdown()


@gpu
def test_replay_matches_eager_across_dtypes(model):
    """Same tokens and logprobs as eager steps, per kv dtype (switched with set_kv_dtype, which must drop the
    graphs: they hold the old cache's addresses)."""
    on, off = _start(model, True), _start(model, False)
    try:
        for kv_dtype in ("auto", "fp8", "int8_per_token_head", "fp8_per_token_head", "auto"):
            on.set_kv_dtype(kv_dtype)
            off.set_kv_dtype(kv_dtype)
            assert on.graphs is None
            assert _runs(on) == _runs(off), kv_dtype
            assert on.graphs.captures == 3 and on.graphs.replays >= 3 * 11, kv_dtype
            assert off.graphs is None
    finally:
        on.shutdown()
        off.shutdown()


@gpu
@pytest.mark.parametrize("level", [1, 2])
def test_recaptured_after_wake(model, level):
    e = _start(model, True)
    try:
        before = _runs(e)
        old = e.graphs
        e.sleep(level)
        assert e.graphs is None and not old.graphs
        e.wake_up()
        assert _runs(e) == before
        assert e.graphs is not old and e.graphs.captures == 3
    finally:
        e.shutdown()


@gpu
def test_replay_rechecks_addresses(model):
    """A graph is never replayed over a cache that moved under it, even without the engine's hook."""
    e = _start(model, True)
    try:
        before = _runs(e)
        graphs = e.graphs
        e.kv.allocate([1.0] * e.cfg.num_layers, [1.0] * e.cfg.num_layers)  # new cache tensors, same engine
        e.kv.build_tables()
        assert _runs(e) == before and e.graphs is graphs and graphs.captures == 6
    finally:
        e.shutdown()


@gpu
def test_graph_memory_released_at_shutdown(model):
    """A second start / decode / shutdown cycle ends where the first ended: the graphs, their pool and their
    static buffers go back (the first cycle keeps one-time costs such as cuBLAS workspaces per stream)."""
    after = []
    for _ in range(2):
        e = _start(model, True)
        _runs(e)
        assert e.graphs.captures == 3
        e.shutdown()
        assert e.graphs is None
        torch.cuda.synchronize()
        after.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
    assert after[1][0] == after[0][0] and after[1][1] <= after[0][1]
