"""The whole engine's memory: the processes it starts (kvdiag/measure/processes.py), their GPU memory as NVML
tells it (faked here: no GPU), and memleak's verdict on processes that outlive shutdown (checks/leftover.py)."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kvdiag.checks.memleak import leftover
from kvdiag.measure import processes as ep
from kvdiag.run.runner import Case, run_cases

MB = 1 << 20


def test_children_are_seen_until_they_end():
    base = ep.children()
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert p.pid in ep.children() and p.pid not in base
        assert "time.sleep(30)" in ep.children()[p.pid]
        t = time.monotonic()
        assert p.pid in ep.wait_children(base, 0.5)  # still alive after the wait
        assert time.monotonic() - t >= 0.5
    finally:
        p.kill()
        p.wait()
    assert ep.wait_children(base, 5) == {}  # ended (and reaped): nothing left


class FakeNvml:
    """pynvml over fake GPUs: {index: (uuid, used bytes, [(pid, bytes)])}."""

    def __init__(self, gpus):
        self.gpus = gpus

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if i not in self.gpus:
            raise RuntimeError("invalid argument")
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return next(i for i, g in self.gpus.items() if g[0] == uuid)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=self.gpus[h][1])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=n) for pid, n in self.gpus[h][2]]


@pytest.fixture
def nvml(monkeypatch):
    def fake(gpus, visible=None):
        monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(gpus))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    return fake


def test_the_engine_is_every_process_it_started_on_every_gpu_it_uses(nvml):
    me, worker0, worker1, other = 100, 101, 102, 999
    nvml({0: ("GPU-a", 9000 * MB, [(me, 500 * MB), (worker0, 4000 * MB), (other, 3000 * MB)]),
          1: ("GPU-b", 4500 * MB, [(worker1, 4000 * MB)]),
          2: ("GPU-c", 700 * MB, [(other, 300 * MB)])})
    v = ep.gpu_view([me, worker0, worker1])
    assert v.matched and v.engine == {"0": 4500 * MB, "1": 4000 * MB, "2": 0}
    assert v.engine_bytes() == 8500 * MB  # another user's process is not the engine's
    assert v.by_pid == {me: 500 * MB, worker0: 4000 * MB, worker1: 4000 * MB}
    assert v.measured("0") == ["0", "1"] and v.used_bytes("0") == 13500 * MB  # GPU 2: not the engine's
    v = ep.gpu_view([me])  # the workers ended: only the GPU of this process
    assert v.measured("0") == ["0"] and v.engine_bytes() == 500 * MB


def test_visible_gpus_by_index_or_uuid_and_a_foreign_pid_namespace(nvml):
    nvml({0: ("GPU-a", 1000 * MB, [(5, 100 * MB)]), 1: ("GPU-b", 2000 * MB, [(6, 200 * MB), (7, 300 * MB)])},
         visible="GPU-b,0,7")  # as CUDA: the list ends at the first entry with no GPU
    v = ep.gpu_view([os.getpid()])  # NVML lists the host's pids (a container): none is ours
    assert not v.matched and v.engine == {"GPU-b": 500 * MB, "0": 100 * MB} and v.by_pid == {}
    assert v.measured("0") == ["GPU-b", "0"]  # every visible GPU: who holds what cannot be told
    nvml({0: ("GPU-a", 1000 * MB, [])})
    v = ep.gpu_view([os.getpid()])  # NVML lists no process: it cannot say
    assert v.engine_bytes() is None


def alive(n, gpu_mib=None):
    return {1000 + i: {"cmd": f"python worker {i}", "gpu_mib": gpu_mib} for i in range(n)}


def judged(per_cycle):
    rec = Case("memleak", "vllm", "m", "auto", "t").result("pass")
    leftover.findings(rec, per_cycle)
    return [(f.severity, f.kind) for f in rec.findings], rec


@pytest.mark.parametrize("per_cycle,expected", [
    ([{}, {}, {}], []),
    ([alive(1, 1500.0), {}, {}], []),  # the last shutdown left nothing
    ([alive(1, 1500.0)], [("error", "engine_process_alive")]),  # one cycle is enough when it holds GPU memory
    ([alive(1), alive(2), alive(3)], [("error", "engine_process_alive")]),  # more every cycle
    ([alive(2), alive(2), alive(2)], [("warning", "process_alive")]),  # a pool kept for the process's life
    ([alive(2, 0.0), alive(2, 0.0)], [("warning", "process_alive")]),
])
def test_processes_alive_after_shutdown(per_cycle, expected):
    got, rec = judged(per_cycle)
    assert got == expected
    assert rec.metrics["processes_after_shutdown"] == [len(a) for a in per_cycle]


def test_the_message_names_the_processes_and_their_memory():
    _, rec = judged([alive(1, 1500.0), alive(6, 1500.0)])
    msg = rec.findings[0].message
    assert "6 process(es)" in msg and "9000 MiB of GPU memory held" in msg
    assert "pid 1000 `python worker 0` holding 1500 MiB" in msg and "and 2 more" in msg


@pytest.mark.slow
def test_a_worker_process_the_engine_never_stops_fails_memleak(random_model, tmp_path):
    from kvdiag.engines.builtin.faults import ORPHAN_MIB

    case = Case("memleak", "builtin", random_model("llama"), "auto", "kvdiag.checks.memleak.run:run",
                id="orphan", params={"device": "cpu", "num_blocks": 16, "num_prompts": 2, "max_tokens": 4,
                                     "cycles": 2, "faults": ["orphan_worker_process"]})
    clean = Case(**{**case.__dict__, "id": "clean", "params": {**case.params, "faults": []}})
    recs = {r.id: r for r in run_cases([case, clean], tmp_path, quiet=True, timeout=600)}
    r = recs["orphan"]
    assert r.status == "fail", r.findings
    f = next(f for f in r.findings if f.kind == "engine_process_alive")
    assert "more after every cycle (1 -> 2)" in f.message and "_ORPHAN" not in f.message
    assert r.metrics["processes_after_shutdown"] == [1, 2]
    after = [s for s in r.metrics["snapshots"] if s["stage"] == "after-shutdown"]
    assert [s["processes"] for s in after] == [1, 2]
    assert after[-1]["rss_mib"] < after[0]["rss_mib"] + ORPHAN_MIB["cpu"]  # not this process's memory
    assert recs["clean"].status == "pass" and recs["clean"].metrics["processes_after_shutdown"] == [0, 0]
    import psutil

    def orphans():
        return [p for p in psutil.process_iter(["cmdline"]) if "os.getppid() == parent" in " ".join(
            p.info["cmdline"] or [])]

    deadline = time.monotonic() + 5
    while orphans() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert orphans() == []  # they end with the worker that started them


def test_memory_the_leftover_processes_hold_is_named_as_theirs():
    """Under the builtin orphan_worker_process fault the driver's views grow by what the processes left running
    hold: the findings name those processes as the holder, not torch's cuBLAS workspaces."""
    from kvdiag.checks.memleak.verdict import Cycle, judge
    from kvdiag.measure.memory import Snapshot, Survivors

    def snap(stage, cycle, used):
        return Snapshot(stage, cycle, 500 * MB, 0, 0, 0, {}, cuda_allocated=32 * MB, cuda_reserved=32 * MB,
                        cuda_peak=64 * MB, driver_used=used * MB, nvml_process=(used - 500) * MB)

    snaps = [snap("baseline", 0, 1100)]
    for n in (1, 2):
        snaps += [snap("after-workload", n, 3000), snap("after-shutdown", n, 1100 + 870 * n)]
    empty = Survivors(frozenset(), 0, frozenset(), 0, {})
    cycles = [Cycle(empty, processes=alive(n, 866.0)) for n in (1, 2)]
    rec = judge(Case("memleak", "builtin", "m", "auto", "t").result("pass"), snaps, cycles, cublas=64 * MB)
    growth = {f.evidence["metric"]: f for f in rec.findings if f.kind == "growth"}
    assert set(growth) == {"driver_used", "nvml_process"}
    assert growth["driver_used"].evidence["holder"] == leftover.HOLDER
    assert growth["driver_used"].evidence["holder_mib"] == pytest.approx(1732)
    (kept,) = [f for f in rec.findings if f.kind == "retained"]
    assert kept.evidence["holder"].startswith(leftover.HOLDER + ": pid 100")
    assert [f.kind for f in rec.findings if f.severity == "error"].count("engine_process_alive") == 1
