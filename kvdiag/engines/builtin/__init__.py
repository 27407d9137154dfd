"""kvdiag's own paged-KV engine (Llama, Mistral, Qwen2, Qwen3); see engine.BuiltinEngine.

Importing this package does not import torch; ``from kvdiag.engines.builtin.engine import BuiltinEngine``.
"""

__all__ = ["BuiltinEngine", "engine_arg_names"]

SPEC_ARGS = ("max_model_len", "block_size", "num_blocks", "kv_cache_memory", "max_num_seqs", "dtype")  # -a sets them
OWN_ARGS = ("max_num_batched_tokens", "ignore_eos", "cuda_graphs")  # -a keys the engine reads itself


def engine_arg_names() -> list[str]:
    """What ``-a`` takes for the builtin engine: the EngineSpec fields it lets -a set, and its own keys."""
    return sorted(SPEC_ARGS + OWN_ARGS)


def __getattr__(name):
    if name == "BuiltinEngine":
        from kvdiag.engines.builtin.engine import BuiltinEngine

        return BuiltinEngine
    raise AttributeError(name)
