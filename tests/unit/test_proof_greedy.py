"""The reproducers of wake-cycle and poison (kvdiag.proof's greedy_script.py): one engine with kvdiag's
arguments runs the prompts, does to the engine what the check did (a sleep and vLLM's wake; the free blocks zeroed,
then poisoned), runs them again and holds the later run to the first; exit 1 exactly when the failure shows. The engine
is the stand-in vLLM (tests/support/fake_vllm), whose faults are known: a wake that leaves stale block tables, a wake
that raises a device fault, fresh blocks read without zeroing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.case import Case
from kvdiag.results import RunRecord

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_vllm"
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def replay(**llm) -> dict:
    return {"engine": "vllm", "llm": {"model": "/m", **llm}, "sampling": {},
            "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def wake_case(fault: str | None, level: int = 1, staged: bool = False, kind: str = "divergence", status="fail"):
    """A wake-cycle case as the check records it on vLLM: failed in cycle 2 of 3."""
    case = Case("wake-cycle", "vllm", "/m", "auto", "t", params={"level": level, "staged": staged, "cycles": 3},
                id=f"wake-cycle/vllm/m/auto/L{level}")
    rec = case.result(status, metrics={
        "level": level, "staged": staged, "max_tokens": 6, "prompts": len(PROMPTS), "prompt_ids": PROMPTS,
        "expected_bytes": 64 << 20, "replay": replay(enable_sleep_mode=True, **({"fake_fault": fault} if fault
                                                                                 else {}))})
    rec.add("error", kind, "cycle 2: request 1 first differs at generated position 1", cycles=[2, 3])
    return rec


def poison_case(fault: str | None, kinds=("nan_output",), value: str = "nan"):
    case = Case("poison", "vllm", "/m", "auto", "t", params={"value": value, "seed": 0}, id="poison/vllm/m/auto")
    rec = case.result("fail", metrics={
        "value": value, "replay": replay(num_gpu_blocks_override=6, enable_prefix_caching=False,
                                         **({"fake_fault": fault} if fault else {})),
        "waves": [{"prompts": PROMPTS[0::2], "max_tokens": 7}, {"prompts": PROMPTS[1::2], "max_tokens": 3},
                  {"prompts": PROMPTS, "max_tokens": 5}]})
    for kind in kinds:
        rec.add("error", kind, f"poison nan: {kind} at request 0 position 0")
    return rec


def write(tmp_path, rec) -> Path:
    from kvdiag.checks.registry import get

    text = get(rec.check).reproducer(rec, RunRecord("k", "", [rec], {}, run_dir=str(tmp_path)))
    assert text is not None and "import kvdiag" not in text and "from kvdiag" not in text
    out = tmp_path / "repro.py"
    out.write_text(text)
    return out


def run_script(script: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(FAKE)}  # the stand-in vLLM (and torch), no kvdiag
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("level, staged, fault, code", [(2, False, "wake", 1), (2, False, "wake_crash", 1),
                                                     (1, True, None, 0)])
def test_the_wake_script_exits_1_exactly_when_a_wake_breaks_the_outputs(tmp_path, level, staged, fault, code):
    """A wake that leaves the outputs changed, or that raises in the engine, reproduces at every level and way of
    waking (level 2: the weights, reload_weights, the cache); the same cycles on a clean engine do not."""
    p = run_script(write(tmp_path, wake_case(fault, level, staged)))
    assert p.returncode == code, p.stdout + p.stderr
    assert ("REPRODUCED" if code else "NOT REPRODUCED") in p.stdout
    assert "kvdiag saw: cycle 2: request 1 first differs" in p.stdout
    if fault == "wake":
        assert "cycle 1: request 1: token 1 is" in p.stdout  # the first cycle already, as kvdiag's words name it
    if fault == "wake_crash":
        assert "cycle 1: wake: RuntimeError: CUDA error: an illegal memory access" in p.stdout


def test_the_wake_script_runs_the_cycles_up_to_the_first_that_failed_and_wakes_as_vllm_documents(tmp_path):
    ns: dict = {"__name__": "reproducer"}
    script = write(tmp_path, wake_case(None, level=2))
    exec(compile(script.read_text(), str(script), "exec"), ns)
    steps = [s["do"] for s in ns["CASE"]["steps"]]
    cycle = ["fill", "sleep", "wake", "reload_weights", "wake", "generate"]
    assert steps == ["generate"] + cycle * 2
    assert [s["tags"] for s in ns["CASE"]["steps"] if s["do"] == "wake"][:2] == [["weights"], ["kv_cache"]]
    assert ns["CASE"]["engine"]["llm"]["enable_sleep_mode"] is True and ns["CASE"]["memory"] is None


def test_a_memory_finding_is_measured_against_the_bytes_kvdiag_expected(tmp_path):
    """A case failed on memory measures each sleep's freed bytes and each wake's return (CUDA's driver view):
    held to kvdiag's rule, at least 90% of the expected bytes freed, back within 10%."""
    from kvdiag.checks.wake_cycle.run import FREED_MIN, RESTORE_TOL

    script = write(tmp_path, wake_case(None, kind="not_freed"))
    ns: dict = {"__name__": "reproducer"}
    exec(compile(script.read_text(), str(script), "exec"), ns)
    memory = ns["CASE"]["memory"]
    assert (memory["freed_min"], memory["restore_tol"], memory["cycles"]) == (FREED_MIN, RESTORE_TOL, [1, 2])
    assert [s["as"] for s in ns["CASE"]["steps"] if s["do"] == "memory"][:3] == ["before 1", "asleep 1", "awake 1"]
    mib, expected = 1 << 20, memory["expected_bytes"]
    ok = {"before 1": 100 * mib, "asleep 1": 100 * mib - expected, "awake 1": 100 * mib}
    assert ns["memory_held"](ok, {**memory, "cycles": [1]}) == []
    short = {**ok, "asleep 1": 100 * mib - expected // 2, "awake 1": 100 * mib + expected}
    said = ns["memory_held"](short, {**memory, "cycles": [1]})
    assert len(said) == 2 and "32.0 MiB freed of 64.0 MiB expected" in said[0] and "awake" in said[1]


@pytest.mark.parametrize("fault, code", [("poison", 1), (None, 0), ("remote_core", 2)])
def test_the_poison_script_exits_1_exactly_when_a_fresh_block_is_read_unzeroed(tmp_path, fault, code):
    """The script poisons the free blocks itself, in vLLM's own block pool and cache tensors: an engine that reads a
    fresh block without zeroing it gives NaN there and reproduces; a clean one gives the zeroed run's outputs; blocks
    it cannot reach are exit 2, never a verdict."""
    p = run_script(write(tmp_path, poison_case(fault)))
    assert p.returncode == code, p.stdout + p.stderr
    if code == 1:
        assert "poisoned wave 1: request 0: 7 non-finite logprob(s), first at position 0" in p.stdout
    elif code == 2:  # the blocks out of the script's reach (the engine core in its own process): not a verdict
        assert "could not fill the free blocks: wave 1: the free blocks filled with zero: AttributeError" in p.stderr
    else:
        assert "NOT REPRODUCED" in p.stdout


@pytest.mark.parametrize("fault, code", [("nan_write", 1), (None, 0), ("state_block", 0)])
def test_a_nan_kv_finding_is_shown_by_the_written_slots_the_script_scans_itself(tmp_path, fault, code):
    """A case failed only on its written KV slots (``nan_kv``): the script runs the poisoned waves alone and, after
    each, scans the slots whose bytes changed since its fill; an engine that writes NaN into the cache (its outputs
    unchanged) reproduces, one that writes finite values does not, though unwritten poisoned slots hold Inf. A
    hybrid's block last handed to its state group is not read as K/V (as kvdiag's scan reads it): the state
    written over part of a poisoned slot leaves Inf beside it, and that is no NaN/Inf K/V."""
    rec = poison_case(fault, kinds=("nan_kv",), value="inf")
    script = write(tmp_path, rec)
    ns: dict = {"__name__": "reproducer"}
    exec(compile(script.read_text(), str(script), "exec"), ns)
    assert [s["do"] for s in ns["CASE"]["steps"][:3]] == ["fill", "generate", "scan"] and ns["CASE"]["compare"] == []
    p = run_script(script)
    assert p.returncode == code, p.stdout + p.stderr
    assert ("wave 1: 4 of the 4 KV slots it wrote hold NaN/Inf" if code else
            "wave 1: none of the 4 KV slots it wrote holds NaN/Inf") in p.stdout
    assert ("REPRODUCED: 3 difference(s)" if code else "NOT REPRODUCED: no KV slot a wave wrote holds") in p.stdout


def test_on_the_cpu_memory_is_left_out_and_the_outputs_still_shown(tmp_path):
    """A case on the CPU failed on memory and on its outputs: the script shows the outputs (it measures memory as
    CUDA's driver sees it, which the CPU has not) and says so in its header; failed on memory alone: no script."""
    from kvdiag.checks.wake_cycle.repro import script as wake_script

    both = wake_case("wake", kind="not_freed")
    both.metrics["device"] = "cpu"
    both.add("error", "divergence", "cycle 1: request 0 first differs at generated position 0", cycles=[1])
    text = wake_script(both)
    assert text.splitlines()[1] == "# Memory is left out: kvdiag measured it on the CPU, the script as CUDA's " \
                                   "driver sees it."
    ns: dict = {"__name__": "reproducer"}
    exec(compile(text, "repro.py", "exec"), ns)
    assert ns["CASE"]["memory"] is None and "memory" not in {s["do"] for s in ns["CASE"]["steps"]}
    p = run_script(write(tmp_path, both))
    assert p.returncode == 1 and "cycle 1: request 1: token 1 is" in p.stdout, p.stdout + p.stderr
    alone = wake_case("wake", kind="not_freed")
    alone.metrics["device"] = "cpu"
    assert wake_script(alone) is None

def test_no_script_where_the_case_passed_recorded_no_start_or_failed_on_nothing_the_script_sees(tmp_path):
    from kvdiag.checks.poison.repro import script as poison_script
    from kvdiag.checks.wake_cycle.repro import script as wake_script

    assert wake_script(wake_case("wake", status="pass")) is None
    rec = wake_case("wake")
    del rec.metrics["replay"]
    assert wake_script(rec) is None
    assert poison_script(poison_case("poison", kinds=("no_fresh_blocks",))) is None  # nothing the script sees


def test_kvdiag_records_what_the_scripts_replay():
    """wake-cycle keeps the prompts' token ids beside its start; poison each wave's ids and length, in order."""
    from types import SimpleNamespace

    from kvdiag.checks.poison.run import Wave
    from kvdiag.checks.poison.run import _replay as poison_replay
    from kvdiag.checks.wake_cycle.run import _replay as wake_replay

    class Engine:
        def replay_args(self):
            return replay(model="/m")

    done = [SimpleNamespace(prompt_token_ids=ids) for ids in ([1], [2, 3], [4])]
    assert wake_replay(Engine(), done) == {"replay": replay(model="/m"), "prompt_ids": [[1], [2, 3], [4]]}
    waves = [Wave(["a", "c"], 9), Wave(["b"], 2)]
    assert poison_replay(Engine(), waves, done)["waves"] == [{"prompts": [[1], [2, 3]], "max_tokens": 9},
                                                             {"prompts": [[4]], "max_tokens": 2}]
    assert wake_replay(object(), done) == {}


def test_kvdiag_proves_a_wake_failure_after_the_run(tmp_path, monkeypatch):
    from kvdiag.run.prove import prove_run

    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    rec = wake_case("wake")
    prove_run(RunRecord("kvdiag wake-cycle -e vllm", "", [rec], {}, run_dir=str(tmp_path)))
    assert rec.metrics["proof"]["reproduced"] == "yes", rec.metrics["proof"]["output"]
    assert (tmp_path / "repro" / "wake-cycle_vllm_m_auto_L1.py").exists()


def prove_with_patch(tmp_path, monkeypatch, rec, fake_fault: str):
    """`selftest --prove` on ``rec`` (its check's caught fault "f1"), the fault's patch putting the stand-in vLLM's
    ``fake_fault`` into the script's engine process: (the fault's row, the run)."""
    from kvdiag.checks.selftest import proofs

    class Traits:
        @staticmethod
        def fault_patch(faults, kv_cache_dtype):
            return f"import os\nos.environ['FAKE_VLLM_FAULT'] = {fake_fault!r}\n"

    monkeypatch.setattr("kvdiag.engines.base.engine_traits", lambda engine: Traits())
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    rec.params["selftest"] = "f1"
    row = {"fault": "f1", "intended": rec.check, "status": "caught", "caught_by_intended": True}
    run = RunRecord("kvdiag selftest -e vllm --prove", "", [rec], {}, run_dir=str(tmp_path),
                    analysis={"selftest": {"faults": [row], "clean": {}, "ok": True}})
    proofs.prove_faults(run, "vllm")
    return row, run


def test_selftest_prove_holds_the_poison_reproducer_to_its_faults_patch(tmp_path, monkeypatch):
    """`selftest --prove`: with the fault's patch in the script's engine process it reproduces, without it it does
    not (the fault was in kvdiag's worker: the case's own arguments name none)."""
    row, run = prove_with_patch(tmp_path, monkeypatch, poison_case(None), "poison")
    assert (row["proof"]["patched"], row["proof"]["plain"], run.analysis["selftest"]["ok"]) == (1, 0, True)


def test_selftest_prove_says_why_a_caught_fault_has_no_reproducer():
    """A caught fault whose failing case has no script (here a memleak case whose engine recorded no start): `selftest
    --prove` says so for such a fault, rather than leaving it out."""
    from rich.console import Console

    from kvdiag.checks.selftest import proofs
    from kvdiag.checks.selftest.view import _proofs

    rec = Case("memleak", "vllm", "/m", "auto", "t", params={"selftest": "kv_cache_kept_after_shutdown"},
               id="memleak/vllm/m/auto").result("fail")
    rec.add("error", "kv_cache_survived", "the KV cache survived the shutdown")
    row = {"fault": "kv_cache_kept_after_shutdown", "intended": "memleak", "status": "caught"}
    run = RunRecord("kvdiag selftest -e vllm --prove", "", [rec], {}, run_dir="/nonexistent",
                    analysis={"selftest": {"faults": [row], "clean": {}, "ok": True}})
    proofs.prove_faults(run, "vllm")
    assert "proof" not in row and run.analysis["selftest"]["ok"] is True
    con = Console(width=80, record=True)
    _proofs(run.analysis["selftest"], con)
    out = " ".join(con.export_text().split())
    assert "kv_cache_kept_after_shutdown: not proved: its failing memleak case has no reproducer (a finding a " \
           "plain script does not show, an engine start kvdiag could not record, or an engine the check writes " \
           "none for)" in out
    row = {"fault": "global_kv_list", "intended": "memleak", "status": "caught"}
    run = RunRecord("kvdiag selftest --prove", "", [], {}, run_dir="/nonexistent",
                    analysis={"selftest": {"faults": [row], "clean": {}, "ok": True}})
    proofs.prove_faults(run, "builtin")  # its faults go into a script's engine; memleak writes none for it
    assert row["unproved"].startswith("its failing memleak case has no reproducer")


@pytest.mark.parametrize("value", ["zero", "nan", "inf", "max"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_the_scripts_fill_puts_the_bits_kvdiags_poison_puts(value, kv_dtype):
    """The numbers a script fills each cache dtype with (``fill_numbers``, as the script applies them) give the same
    bits as kvdiag's own fill of the same blocks (``kv_tensors.fill_blocks``); fp8 stored as uint8 as the fp8 it
    holds."""
    from types import SimpleNamespace

    import torch

    from kvdiag.checks.kv_tensors import fill_blocks, fill_numbers

    fp8 = torch.float8_e5m2 if kv_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    numbers = fill_numbers(value, kv_dtype)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.uint8):
        ours = torch.ones(4, 3, dtype=torch.float32).to(dtype if dtype != torch.uint8 else fp8)
        theirs = ours.clone() if dtype != torch.uint8 else ours.clone().view(torch.uint8)
        fill_blocks(SimpleNamespace(layers=[SimpleNamespace(k=ours)]), [1, 3], value)
        idx = torch.tensor([1, 3])
        name = str(theirs.dtype).split(".")[-1]
        if theirs.element_size() == 1:
            theirs.view(torch.uint8).index_fill_(0, idx, numbers[name])
        else:
            theirs.index_fill_(0, idx, float(numbers[name]))
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), (dtype, value)


def test_a_worker_a_wake_killed_is_proved_from_what_it_kept(tmp_path):
    """A wake that kills the worker leaves a crashed record with what the worker kept before the first sleep (its
    start and prompts): the script runs every cycle and reproduces when the engine dies after its reference run."""
    rec = wake_case("wake_crash", status="crashed", kind="crashed")
    p = run_script(write(tmp_path, rec))
    assert p.returncode == 1 and "REPRODUCED: the engine failed after its reference run" in p.stdout, p.stdout
