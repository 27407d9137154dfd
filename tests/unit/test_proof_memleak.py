"""memleak's reproducer (kvdiag.proof's memleak_script.py): in a fresh process a baseline census of the live
tensors, then each cycle as kvdiag ran it (start with kvdiag's arguments, the prompts, the shutdown) and a census of
what survived, held to what kvdiag saw; exit 1 exactly when the leak shows. The engine is the stand-in vLLM
(tests/support/fake_vllm), whose leaks are known: the KV cache kept in a module global at shutdown (``leak_kv``), a
512 KiB tensor kept at every start (``leak_grows``), a process launched at every start and never stopped
and the garbage collector frozen at start (``left_behind``)."""

from __future__ import annotations

import os
import subprocess
import sys

from test_proof_greedy import FAKE, prove_with_patch, write  # the stand-in vLLM; a case's script

from kvdiag.case import Case

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
GEOMETRY = {"num_blocks": 8, "block_size": 2, "num_kv_heads": 1, "head_size": 4, "layers": 1}  # the fake's cache
MiB = 1 << 20


def leak_case(fault: str | None, kinds=("kv_cache_survived",), cycles: int = 2):
    """A memleak case as the check records it on vLLM, failed on ``kinds``."""
    case = Case("memleak", "vllm", "/m", "auto", "t", params={"cycles": cycles}, id="memleak/vllm/m/auto")
    llm = {"model": "/m", "num_gpu_blocks_override": 8, **({"fake_fault": fault} if fault else {})}
    rec = case.result("fail", metrics={
        "cycles": cycles, "max_tokens": 3, "prompt_ids": PROMPTS, "replay_kv_geometry": GEOMETRY,
        "replay": {"engine": "vllm", "llm": llm, "sampling": {}, "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
        "replay_cycles": [llm] * cycles, "children_exit_s": 1.0})
    evidence = {"kv_cache_survived": {"survived_mib": 0.0002, "cycle": 1},
                "tensor_survived": {"per_cycle_mib": [0.5, 1.0], "holder": "KEPT"},
                "restart_impossible": {"reproduce": "python3 -c 'import vllm'"},
                "gc_frozen": {"frozen": [9000, 9000], "baseline": 0},
                "engine_process_alive": {"processes": {"7": {"cmd": "python -c ...", "gpu_mib": None}},
                                         "counts": [1, 2]},
                "leftover_processes": {}}
    for kind in kinds:
        rec.add("error", kind, f"memleak: {kind}", **evidence[kind])
    return rec


def test_the_script_reproduces_survivors_that_grow_every_cycle(tmp_path):
    """A tensor kept at every start: the script's own census sees 0.5 then 1 MiB survive, as kvdiag did."""
    env = {**os.environ, "PYTHONPATH": str(FAKE)}  # the stand-in vLLM (and the real torch), no kvdiag
    p = subprocess.run([sys.executable, str(write(tmp_path, leak_case("leak_grows", ("tensor_survived",))))],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "REPRODUCED: the survivors grow every cycle" in p.stdout
    assert "here 0.5 → 1 MiB" in p.stdout and "kvdiag saw: memleak: tensor_survived" in p.stdout


def test_selftest_prove_holds_the_memleak_reproducer_to_its_faults_patch(tmp_path, monkeypatch):
    """`selftest --prove`: with the fault's patch in the script's engine process the KV cache survives shutdown
    (known by identity and by its shape) and the script exits 1; without it nothing survives and it exits 0."""
    row, run = prove_with_patch(tmp_path, monkeypatch, leak_case(None, ("kv_cache_survived",)), "leak_kv")
    assert (row["proof"]["patched"], row["proof"]["plain"], run.analysis["selftest"]["ok"]) == (1, 0, True), \
        row["proof"]["output"]
    text = (tmp_path / "repro" / "memleak_vllm_m_auto.py").read_text()
    assert "'kv_cache': True" in text and "'cycles': [{}]" in text  # the first cycle shows it: one engine start


def test_the_script_finds_processes_and_frozen_objects_a_shutdown_left(tmp_path, monkeypatch):
    """A start that launches a process no shutdown stops and freezes the garbage collector: the script's own look
    (its process's children after kvdiag's wait, ``gc.get_freeze_count()``) sees both with the fault's patch and
    exits 1; without it, 0."""
    rec = leak_case(None, ("engine_process_alive", "gc_frozen"))
    row, _ = prove_with_patch(tmp_path, monkeypatch, rec, "left_behind")
    proof = row["proof"]
    assert (proof["patched"], proof["plain"]) == (1, 0), proof["patched_output"] + proof["output"]
    said = next(line for line in proof["patched_output"].splitlines() if line.startswith("REPRODUCED: "))
    assert "objects stay frozen by gc.freeze(); 1 process(es) the engine started are alive after shutdown" in said
    assert "NOT REPRODUCED" in proof["output"] and "(expected none" in proof["output"]


def test_no_script_where_the_case_passed_failed_to_restart_or_failed_where_the_script_does_not_look():
    from kvdiag.checks.memleak.repro import script

    assert script(leak_case(None, ("kv_cache_survived",))) is not None
    rec = leak_case(None)
    rec.status = "pass"
    assert script(rec) is None
    assert script(leak_case(None, ("kv_cache_survived", "restart_impossible"))) is None  # its own command proves it
    assert script(leak_case(None, ("leftover_processes",))) is None  # processes: not the script's census
    rec = leak_case(None)
    del rec.metrics["replay"]
    assert script(rec) is None


def test_the_script_expects_what_each_finding_measured():
    """Each finding's own numbers become what the script holds its census to."""
    from kvdiag.checks.memleak.repro import expected
    from kvdiag.results import Finding

    def f(kind, **evidence):
        return Finding("error", kind, kind, evidence)

    got = expected([f("kv_shaped_survived", mib=0.5), f("kv_scaled_survived", mib=3.0),
                    f("retained", mib={"tensor_bytes": 80.0, "cuda_allocated": 90.0}),
                    f("growth", metric="rss", growth_mib=[20.0])], GEOMETRY)
    assert got == {"geometry": GEOMETRY, "kv_shaped": True, "bytes": 3 * MiB, "cuda_allocated": 90 * MiB}
    got = expected([f("kv_proportional", holders=[{"holder": "h", "mib": [2.0, 4.0]}]),
                    f("growth", metric="tensor_bytes", growth_mib=[1.0, 1.0])], None)
    assert got == {"geometry": None, "bytes": 2 * MiB, "grows": [0, 2 * MiB]}


def test_kvdiag_records_each_cycles_start_and_the_caches_geometry():
    from types import SimpleNamespace

    from kvdiag.checks.memleak.kv_shape import Geometry
    from kvdiag.checks.memleak.run import _replay

    def cycle(blocks):
        replay = {"engine": "vllm", "llm": {"model": "/m", "num_gpu_blocks_override": blocks}}
        kv = SimpleNamespace(geometry=Geometry(blocks, 16, 2, 64, 4))
        return SimpleNamespace(replay={"replay": replay, "prompts": PROMPTS}, kv=kv)

    got = _replay([cycle(16), cycle(32)])
    assert got["prompt_ids"] == PROMPTS and got["replay"]["llm"]["num_gpu_blocks_override"] == 16
    assert [c["num_gpu_blocks_override"] for c in got["replay_cycles"]] == [16, 32]
    assert got["replay_kv_geometry"] == {"num_blocks": 16, "block_size": 16, "num_kv_heads": 2, "head_size": 64,
                                  "layers": 4}
    assert _replay([SimpleNamespace(replay={}, kv=None)]) == {}  # an engine that cannot say how it started
