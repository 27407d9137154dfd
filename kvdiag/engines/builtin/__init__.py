"""kvdiag's own paged-KV engine (Llama, Mistral, Qwen2, Qwen3); see engine.BuiltinEngine.

Its public API, what a reproducer of a failure on it imports (``kvdiag.proof``), is ``BuiltinEngine`` and the
``EngineSpec`` it starts from: ``from kvdiag.engines.builtin import BuiltinEngine, EngineSpec``. Importing this
package does not import torch (``BuiltinEngine`` does, when it is first named). What kvdiag asks the engine before
any worker starts is ``TRAITS`` below; its self-test faults are ``selftest.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdiag.engines.builtin.arg_names import engine_arg_names
from kvdiag.engines.protocol import EngineSpec
from kvdiag.engines.traits import EngineTraits

if TYPE_CHECKING:
    from kvdiag.engines.builtin.engine import BuiltinEngine
    from kvdiag.engines.selftest import Catalogue

__all__ = ["TRAITS", "BuiltinEngine", "EngineSpec", "engine_arg_names"]


def __getattr__(name: str):
    """``BuiltinEngine``, imported (with torch) when it is first asked for."""
    if name == "BuiltinEngine":
        from kvdiag.engines.builtin.engine import BuiltinEngine

        return BuiltinEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class BuiltinTraits(EngineTraits):
    """What kvdiag asks the builtin engine before any worker starts (kvdiag.engines.traits), without importing torch.
    It runs wherever torch does, records no fault firing, and its process may hold any number of engines."""

    preload = ("torch", "kvdiag.engines.builtin.engine", "tokenizers")  # not transformers: tokenizer.py
    shutdown_collects = True  # shutdown() ends with gc.collect() (and empty_cache() on CUDA)
    children_exit_s = 1.0  # it starts no process: one alive after shutdown() is a leak whatever the wait
    cpu_parallel = True  # small models use one core better than two; threads share the weights (share_weights)

    def model_problem(self, folder: str) -> str | None:
        """A model of a family the engine does not implement (config.py), said before any worker starts."""
        from kvdiag.engines.builtin.config import ModelConfig
        from kvdiag.errors import UserError

        try:
            ModelConfig.from_path(folder)
        except UserError as e:
            return str(e)
        return None

    def resolve_faults(self, engine: str, names: list[str]) -> list[str]:
        """Its compiled-in faults (faults.py), aliases expanded."""
        from kvdiag.engines.builtin.faults import Faults

        return list(Faults.parse(names).enabled)

    def engine_arg_names(self) -> list[str]:
        return engine_arg_names()

    def kv_dtypes(self) -> list[str]:
        """The dtype registry's builtin dtypes (kvdiag.dtypes), listed without importing torch."""
        from kvdiag.dtypes import BUILTIN_DTYPES

        return list(BUILTIN_DTYPES)

    def shared_gpu_bytes(self, model: str, engine_args: dict, weights: int) -> int:
        """GPU memory one case takes when cases share a GPU: 2.5 x the weights (weights, activations, KV cache) +
        1 GiB (the CUDA context)."""
        return int(2.5 * weights) + (1 << 30)

    def max_model_len(self, model: str, engine_args: dict) -> int:
        """As every engine, and never past a sliding window: the engine caps its length there (engine.py)."""
        from kvdiag.models import config, sliding_window

        window = sliding_window(config(model, text=True))
        return min(super().max_model_len(model, engine_args), window or 1 << 62)

    def path_config(self, path: str, need: dict):
        """How it takes each path of the ``paths`` check: paths.py."""
        from kvdiag.engines.builtin.paths import path_config

        return path_config(path, need)

    def selftest(self) -> Catalogue:
        """The faults compiled into the engine (faults.py), as the self-test runs them: selftest.py."""
        from kvdiag.engines.builtin.selftest import CATALOGUE

        return CATALOGUE

    def fault_patch(self, faults: list[str], kv_cache_dtype: str) -> str:
        """Every engine start of the script's process re-introduces ``faults`` (fault_patch.py): its spec, as
        kvdiag recorded it, carries none."""
        return f"from kvdiag.engines.builtin import fault_patch\nfault_patch.apply({list(faults)!r})\n"


TRAITS = BuiltinTraits()
