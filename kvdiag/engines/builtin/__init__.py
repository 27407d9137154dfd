"""kvdiag's own paged-KV engine (Llama, Mistral, Qwen2, Qwen3); see engine.BuiltinEngine.

Importing this package does not import torch; ``from kvdiag.engines.builtin.engine import BuiltinEngine``.
"""

__all__ = ["engine_arg_names"]

SPEC_ARGS = ("max_model_len", "block_size", "num_blocks", "kv_cache_memory", "max_num_seqs", "dtype")  # -a sets them
OWN_ARGS = ("max_num_batched_tokens", "ignore_eos", "cuda_graphs")  # -a keys the engine reads itself


def engine_arg_names() -> list[str]:
    """What ``-a`` takes for the builtin engine: the EngineSpec fields it lets -a set, and its own keys."""
    return sorted(SPEC_ARGS + OWN_ARGS)

# What the scheduler asks without importing torch (kvdiag.engines.base.engine_traits).
PRELOAD = ("torch", "kvdiag.engines.builtin.engine", "tokenizers")  # not transformers: tokenizer.py


def shared_gpu_bytes(model: str, engine_args: dict, weights: int) -> int:
    """GPU memory one case takes when cases share a GPU: 2.5 x the weights (weights, activations, KV cache) + 1 GiB
    (the CUDA context)."""
    return int(2.5 * weights) + (1 << 30)
