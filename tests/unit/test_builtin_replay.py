"""The builtin engine says how it was started (``protocol.Replayable``), as its failures' reproducers start it again
through its public API (``kvdiag.engines.builtin``: ``BuiltinEngine``, ``EngineSpec``): the spec as ``start`` got
it, without its faults (a self-test's fault goes into a reproducer by its patch, never by the recorded spec), and
the environment it read. The paths, poison, wake-cycle and memleak scripts written for it name that API and no vLLM;
those written for vLLM name no kvdiag."""

import json
from dataclasses import replace

import pytest
import torch

from kvdiag.assets import TINY_MODEL


def test_an_engine_started_from_its_replay_args_is_started_as_kvdiag_started_it_but_for_the_faults():
    from kvdiag.engines.builtin import BuiltinEngine, EngineSpec  # what a reproducer imports

    spec = EngineSpec(model=str(TINY_MODEL), device="cpu", dtype="float32", block_size=8, num_blocks=14,
                      prefix_caching=True, faults=("preempt_keeps_freed_blocks",),
                      engine_args={"ignore_eos": True, "preemption": 1})
    e = BuiltinEngine()
    assert e.replay_args() is None  # nothing started: nothing to repeat
    e.start(spec)
    r = e.replay_args()
    e.shutdown()
    assert json.loads(json.dumps(r)) == r and r["engine"] == "builtin"  # a script carries it as a literal
    assert "faults" not in r["spec"] and EngineSpec(**r["spec"]) == replace(spec, faults=())
    assert r["env"]["OMP_NUM_THREADS"] == str(torch.get_num_threads())  # a CPU sum's order follows the threads


@pytest.mark.parametrize("script", ["paths_script.py", "greedy_script.py", "memleak_script.py"])
@pytest.mark.parametrize("engine, has, lacks", [
    ("builtin", "from kvdiag.engines.builtin import BuiltinEngine, EngineSpec", "vllm"),
    ("vllm", "from vllm import LLM", "kvdiag.engines"),
])
def test_a_script_for_several_engines_keeps_only_the_lines_of_its_engine(script, engine, has, lacks):
    from kvdiag.proof.fill import filled

    text = filled(script, {"title": "t"}, engine=engine)
    compile(text, "repro.py", "exec")
    assert has in text and lacks not in text.lower() and "# only:" not in text
    assert "CASE = {'title': 't'}" in text
