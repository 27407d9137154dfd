"""kvdiag's own paged-KV engine (Llama, Mistral, Qwen2, Qwen3); see engine.BuiltinEngine.

Importing this package does not import torch; ``from kvdiag.engines.builtin.engine import BuiltinEngine``.
"""

__all__ = ["BuiltinEngine"]


def __getattr__(name):
    if name == "BuiltinEngine":
        from kvdiag.engines.builtin.engine import BuiltinEngine

        return BuiltinEngine
    raise AttributeError(name)
