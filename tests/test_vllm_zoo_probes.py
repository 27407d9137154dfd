"""Issue 27: kvdiag's memleak, wake-cycle and poison verdicts on each zoo family, eager, against plain vLLM doing the
same thing to the same model, on a CUDA GPU with real vLLM:

- memleak: three start / generate / shutdown cycles (tests/vllm_gpu_probe.py ``eager``, kvdiag's engine arguments):
  kvdiag fails exactly when vLLM's memory grows from one shutdown to the next or its engine outlives its shutdown,
  and what it holds after the last shutdown is what plain vLLM holds;
- wake-cycle, levels 1 and 2: the same sleep / wake cycles (``wake``): kvdiag's outputs after each wake are the
  same as before exactly when plain vLLM's are;
- poison (the families whose blocks the plain probe fills: full, sliding and QK-normed attention; the MLA model has
  its own test in test_vllm_gpu.py, the hybrid its fault probe): NaN in every free block before each wave
  (tests/vllm_sliding_probe.py): kvdiag fails exactly when plain vLLM's outputs change or go non-finite.

    KVDIAG_GPU_OUT=/some/dir python3 -m pytest -m "cuda and vllm" tests/test_vllm_zoo_probes.py
"""

from __future__ import annotations

import json

import pytest
from probes import plain_probe
from test_vllm_gpu import FAST, OUT, kvdiag, pytestmark, shim_args  # noqa: F401 - GPU marks apply too

FAMILIES = ("qwen3", "gemma3", "llama-outlier", "deepseek-v2", "granite-hybrid")
EAGER = ("-a", "enforce_eager=true")


def model_of(name: str) -> str:
    from kvdiag.zoo import resolve

    return str(resolve(f"zoo:{name}"))


def engine_of(model: str) -> list[str]:
    """kvdiag's engine arguments for a memleak or wake-cycle case, eager (its explicit KV cache)."""
    from kvdiag.engines.vllm.sizing import kv_cache_bytes

    return ["enforce_eager=true", f"kv_cache_memory_bytes={kv_cache_bytes(model)}", "gpu_memory_utilization=0.05",
            "max_model_len=2048", "max_num_seqs=64", *shim_args(model)]


def logged(name: str, probe: dict, case: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "commands.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "probe": probe, "status": case["status"],
                            "findings": [[x["severity"], x["kind"]] for x in case["findings"]]}) + "\n")


@pytest.mark.parametrize("name", FAMILIES)
def test_each_zoo_family_s_memleak_verdict_is_plain_vllms(name):
    model = model_of(name)
    code, run, _ = kvdiag(f"zoo-memleak-{name}", "memleak", "-e", "vllm", "-m", f"zoo:{name}", "-d", "auto", *EAGER)
    (case,) = run["cases"]
    plain = plain_probe("vllm_gpu_probe.py", "eager", model, *engine_of(model), timeout=900)
    logged(f"zoo-memleak-probe-{name}", plain, case)
    alloc = plain["allocated_after_shutdown_mib"]
    leaks = max(alloc) - min(alloc) >= 4 or any(plain["llm_engine_alive_after_shutdown"])
    assert (case["status"] == "fail") == leaks, (plain, case["findings"])
    mine = case["metrics"]["held_mib"]["cuda_allocated"]
    assert abs(mine[-1] - alloc[-1]) < 16, (mine, alloc)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_zoo_family_s_wake_cycle_verdicts_are_plain_vllms(name):
    model = model_of(name)
    code, run, _ = kvdiag(f"zoo-wake-{name}", "wake-cycle", "-e", "vllm", "-m", f"zoo:{name}", "-d", "auto",
                          "-l", "1", "-l", "2", *EAGER)
    assert len(run["cases"]) == 2, run["cases"]
    for case in run["cases"]:
        level, cycles = case["metrics"]["level"], case["metrics"]["cycles"]
        plain = plain_probe("vllm_gpu_probe.py", "wake", model, str(level), str(len(cycles)), *engine_of(model),
                            timeout=900)
        logged(f"zoo-wake-probe-{name}-{level}", plain, case)
        assert [c["identical"] for c in cycles] == plain["identical"], (level, plain, cycles)
        assert (case["status"] == "pass") == all(plain["identical"]), (level, plain, case["findings"])


@pytest.mark.parametrize("name", ("qwen3", "gemma3", "llama-outlier"))
def test_each_zoo_family_s_poison_verdict_is_plain_vllms(name):
    model = model_of(name)
    plain = plain_probe("vllm_sliding_probe.py", model, "wave:nan", "--block=default", timeout=900)
    wave = plain["runs"]["wave:nan"]
    broken = wave["diverged"] > 0 or wave["nonfinite_logprobs"] > 0
    code, run, _ = kvdiag(f"zoo-poison-{name}", "poison", "-e", "vllm", "-m", f"zoo:{name}", "-d", "auto", *FAST)
    (case,) = run["cases"]
    logged(f"zoo-poison-probe-{name}", {k: v for k, v in plain.items() if k != "groups"}, case)
    assert wave["filled"] > 0 and case["metrics"]["fresh_blocks"] > 0, (plain, case["metrics"])
    assert (case["status"] == "fail") == broken and code == int(broken), (plain, case["findings"])
