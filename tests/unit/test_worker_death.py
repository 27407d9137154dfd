"""A dead worker says why: its `crashed` finding names the last stage of its case's log and the line that says what
failed (kvdiag/death.py), searched in the whole log, not in a tail that faulthandler's module list fills."""

from __future__ import annotations

import time

import pytest

from kvdiag.death import SCAN_BYTES, cause, hung_at
from kvdiag.results import read_jsonl
from kvdiag.run.runner import Case, run_cases

SITE = "/usr/local/lib/python3.12/dist-packages"
# faulthandler's last words after a fatal error: every extension module loaded, on one line
MODULES = "Extension modules: " + ", ".join(
    ["numpy.core._multiarray_umath", "numpy.core._multiarray_tests", "torch._C", "torch._C._fft", "torch._C._nn",
     "yaml._yaml", "sentencepiece._sentencepiece", "zmq.backend.cython._zmq", "msgspec._core", "uvloop.loop"]
    + [f"vllm_ext_{i}._C" for i in range(600)]) + " (total: 610)"

SEGFAULT_DUMP = f"""\
INFO 05-01 12:00:00 [gpu_model_runner.py:1901] Model loading took 0.94 GiB and 1.2 seconds
--- kvdiag stage: sleep/wake cycles (wake-cycle/vllm/qwen3/fp8) ---
Traceback (most recent call last):
  File "{SITE}/transformers/utils/import_utils.py", line 2045, in _get_module
ModuleNotFoundError: No module named 'flash_attn'
INFO 05-01 12:00:03 [gpu_worker.py:104] Sleep mode freed 30.1 GiB memory
Fatal Python error: Segmentation fault

Thread 0x00007f54245846c0 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 359 in wait
  File "{SITE}/tqdm/_monitor.py", line 60 in run
  File "/usr/lib/python3.12/threading.py", line 1075 in _bootstrap_inner

Current thread 0x00007f3b8c8a4740 (most recent call first):
  File "/usr/lib/python3.12/contextlib.py", line 81 in inner
  File "{SITE}/vllm/v1/worker/gpu_model_runner.py", line 2254 in execute_model
  File "{SITE}/torch/utils/_contextlib.py", line 120 in decorate_context
  File "{SITE}/vllm/v1/worker/gpu_worker.py", line 452 in execute_model
  File "/work/kvdiag/kvdiag/checks/wake_cycle.py", line 88 in run

{MODULES}
"""

CUDA_TRACEBACK = f"""\
--- kvdiag stage: lm_eval (accuracy/vllm/qwen3/fp8) ---
ERROR 05-01 12:01:00 [core.py:710] EngineCore encountered a fatal error.
Traceback (most recent call last):
  File "{SITE}/vllm/v1/engine/core.py", line 701, in run_engine_core
    engine_core.run_busy_loop()
  File "{SITE}/vllm/v1/worker/gpu_model_runner.py", line 1500, in execute_model
    valid_sampled_token_ids = sampled_token_ids.tolist()
                              ^^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.

terminate called after throwing an instance of 'c10::Error'
  what():  CUDA error: an illegal memory access was encountered
Exception raised from c10_cuda_check_implementation at /pytorch/c10/cuda/CUDAException.cpp:43 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f1c2a8a8e28 in {SITE}/torch/lib/libc10.so)
Fatal Python error: Aborted

Current thread 0x00007f3b8c8a4740 (most recent call first):
  File "{SITE}/torch/cuda/__init__.py", line 1023 in synchronize
  File "{SITE}/vllm/v1/worker/gpu_worker.py", line 300 in sleep

{MODULES}
"""

NCCL_FAILURE = f"""\
--- kvdiag stage: engine start (accuracy/vllm/qwen3/auto) ---
[rank1]: Traceback (most recent call last):
[rank1]:   File "{SITE}/vllm/distributed/parallel_state.py", line 1000, in init_distributed_environment
[rank1]:     torch.distributed.barrier()
[rank1]: torch.distributed.DistBackendError: NCCL error in: \
/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, \
internal error - please report this issue to the NCCL developers, NCCL version 2.26.2
[rank1]: ncclInternalError: Internal check failed.
[rank1]: Last error:
[rank1]: Bootstrap : no socket interface found
"""

PYTHON_EXCEPTION = f"""\
--- kvdiag stage: drift probe (drift/vllm/qwen3/fp8) ---
Traceback (most recent call last):
  File "/work/kvdiag/kvdiag/checks/drift.py", line 10, in run
    out = engine.generate(prompts)
  File "{SITE}/vllm/entrypoints/llm.py", line 400, in generate
    raise KeyError("max_tokens")
KeyError: 'max_tokens'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/work/kvdiag/kvdiag/checks/drift.py", line 12, in run
    raise ValueError("bad prompt") from None
ValueError: The decoder prompt (length 5000) is longer than the maximum model length of 4096.
INFO 05-01 12:02:00 [llm.py:300] shutting down
"""


def test_a_segfault_is_read_at_the_innermost_vllm_or_torch_frame_past_the_module_list():
    got = cause(SEGFAULT_DUMP)
    assert got.stage == "sleep/wake cycles"
    assert got.line == "Fatal Python error: Segmentation fault"  # not the earlier, handled ModuleNotFoundError
    assert got.frame == "vllm/v1/worker/gpu_model_runner.py:2254 (execute_model)"  # its thread's, not tqdm's
    assert got.describe() == (" in stage sleep/wake cycles: Fatal Python error: Segmentation fault at "
                              "vllm/v1/worker/gpu_model_runner.py:2254 (execute_model)")
    assert len(MODULES) > 6000 and "Extension modules" not in str(got) and "torch._C" not in str(got)


def test_a_cuda_error_outranks_the_abort_and_the_terminate_it_caused():
    got = cause(CUDA_TRACEBACK)
    assert (got.stage, got.line) == ("lm_eval", "CUDA error: an illegal memory access was encountered")
    assert got.frame == "torch/cuda/__init__.py:1023 (synchronize)"  # in the evidence; the message names the error
    assert got.describe() == " in stage lm_eval: CUDA error: an illegal memory access was encountered"
    assert got.evidence() == {"stage": "lm_eval", "cause": got.line, "frame": got.frame}


def test_an_nccl_error_is_named_over_the_exception_that_carries_it():
    got = cause(NCCL_FAILURE)
    assert got.stage == "engine start" and got.frame is None
    assert got.line.startswith("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356")
    assert cause("ncclInternalError: Internal check failed.\n").line == "ncclInternalError: Internal check failed."


def test_a_plain_exception_is_the_line_ending_the_last_traceback():
    got = cause(PYTHON_EXCEPTION)
    assert got.stage == "drift probe" and got.frame is None
    assert got.line == "ValueError: The decoder prompt (length 5000) is longer than the maximum model length of 4096."
    prefixed = "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in f\n" \
               "other process: hello\n[rank0]: AssertionError: shapes differ\n"
    assert cause(prefixed).line == "AssertionError: shapes differ"
    cut_short = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nINFO 12:00 [core.py:1] step\n"
    assert cause(cut_short).line is None  # a log line after a traceback is not its exception


HANG_DUMP = f"""\
INFO 11-27 20:10:01 [multiproc_executor.py:580] all workers exited gracefully
Thread 0x00007f54245846c0 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 359 in wait
  File "{SITE}/tqdm/_monitor.py", line 60 in run

Current thread 0x00007f3b8c8a4740 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 655 in wait
  File "{SITE}/vllm/distributed/device_communicators/shm_broadcast.py", line 512 in acquire_read
  File "{SITE}/vllm/v1/executor/multiproc_executor.py", line 301 in collective_rpc
  File "/work/main/kvdiag/engines/vllm/workers.py", line 118 in ask
  File "/work/main/kvdiag/checks/memleak/kv_identity.py", line 61 in in_workers
  File "/work/main/kvdiag/run/worker.py", line 140 in _run_one
"""


def test_a_hung_worker_is_read_at_its_innermost_kvdiag_frame_then_the_engine_frame_it_waits_in():
    """The all-threads dump a timeout asks for: the main thread (listed last) waits in vLLM's rpc, called by kvdiag's
    workers.ask; the runner's own frames and the standard library's are never the answer."""
    assert hung_at(HANG_DUMP) == ["kvdiag/engines/vllm/workers.py:118 (ask)",
                                  "vllm/distributed/device_communicators/shm_broadcast.py:512 (acquire_read)"]
    assert hung_at(SEGFAULT_DUMP.replace("Fatal Python error: Segmentation fault", "")) == [
        "kvdiag/checks/wake_cycle.py:88 (run)", "vllm/v1/worker/gpu_model_runner.py:2254 (execute_model)"]
    assert hung_at("INFO nothing dumped") == []
    wait = '  File "/usr/lib/python3.12/threading.py", line 655 in wait\n'
    term = f'  File "{SITE}/zmq/sugar/context.py", line 264 in term\n'
    gc_hang = HANG_DUMP.replace(wait, "  Garbage-collecting\n" + term, 1)
    assert hung_at(gc_hang)[0] == "kvdiag/engines/vllm/workers.py:118 (ask)"  # found past faulthandler's gc line


def test_what_the_log_does_not_show_is_not_stated():
    assert cause("") == cause(MODULES) == cause("\n\n(total: 3)\n")
    assert cause("").describe() == "" and cause("").evidence() == {}
    assert cause("--- kvdiag stage: lm_eval\nhello\n").describe() == " in stage lm_eval"
    assert cause("--- kvdiag stage: workload (cycle 1) (memleak/x) ---\n").stage == "workload (cycle 1)"
    wrapped = "Extension modules: torch._C, torch._C._fft,\ntorch._C._nn, ValueError_ext (total: 3)\n"
    assert cause(wrapped).line is None  # a wrapped rest of the module list is left out too


def test_the_whole_scanned_log_is_read_in_well_under_a_second():
    noise = "INFO 05-01 12:00:00 [core.py:1] step 1 done: 12 tokens, KV cache usage 3.1%\n"
    log = "--- kvdiag stage: lm_eval (c) ---\nRuntimeError: CUDA error: misaligned address\n" \
          + noise * (SCAN_BYTES // len(noise)) + SEGFAULT_DUMP.split("\n", 2)[2]
    t0 = time.process_time()  # CPU seconds: what a loaded machine does not stretch
    got = cause(log)
    assert time.process_time() - t0 < 1.0
    assert got.line == "CUDA error: misaligned address" and got.stage == "lm_eval"  # the dump without its stage


@pytest.fixture(scope="module")
def dead(tmp_path_factory):
    """Two cases whose workers die past a long module list, run by the real runner; their records as written."""
    run_dir = tmp_path_factory.mktemp("dead")
    cuda = ["Traceback (most recent call last):", '  File "x.py", line 1, in f',
            "RuntimeError: CUDA error: an illegal memory access was encountered"]
    cases = [Case("t", "e", "m", "d", "case_fns:dies", id="t/segv",
                  params={"stage": "sleep/wake cycles", "lines": cuda, "signal": "SIGSEGV"}),
             Case("t", "e", "m", "d", "case_fns:dies", id="t/abrt", params={"stage": "lm_eval", "signal": "SIGABRT"})]
    run_cases(cases, run_dir, quiet=True, jobs=2, timeout=60)
    return read_jsonl(run_dir / "results.jsonl")


def test_a_dead_worker_s_finding_names_its_stage_and_error_line_not_the_module_list(dead):
    rec = dead["t/segv"]
    (f,) = rec.findings
    assert rec.status == "crashed" and f.kind == "crashed" and f.evidence["signal"] == "SIGSEGV"
    assert f.message == ("worker died with SIGSEGV (segmentation fault) in stage sleep/wake cycles: "
                         "CUDA error: an illegal memory access was encountered")
    assert f.evidence["stage"] == "sleep/wake cycles" and f.evidence["cause"].startswith("CUDA error")
    assert "fake_ext" not in str(f.evidence) and "fake_ext" not in rec.log_tail  # the list would fill the tail
    assert "CUDA error: an illegal memory access" in rec.log_tail


def test_a_worker_that_only_aborted_is_read_at_faulthandler_s_line_and_frame(dead):
    (f,) = dead["t/abrt"].findings
    assert f.message.startswith("worker died with SIGABRT (aborted) in stage lm_eval: Fatal Python error: Aborted at ")
    assert f.evidence["cause"] == "Fatal Python error: Aborted"
    frame = f.evidence["frame"]
    assert "tests/support/case_fns.py:" in frame and frame.endswith(" (dies)")  # os.kill's caller
    assert f.message.endswith(f.evidence["frame"]) and "fake_ext" not in f.message
