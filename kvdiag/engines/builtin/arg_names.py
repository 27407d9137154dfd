"""The ``-a`` keys the builtin engine takes: the EngineSpec fields ``-a`` may set, and the keys the engine reads
itself. The engine (``engine.py``) and its traits (the package's ``TRAITS``) read them here, without torch."""

SPEC_ARGS = ("max_model_len", "block_size", "num_blocks", "kv_cache_memory", "max_num_seqs", "dtype")  # -a sets them
# -a keys the engine reads itself; preemption, enable_chunked_prefill and kv_connector_dir: the KV paths of
# scheduler.py
OWN_ARGS = ("max_num_batched_tokens", "ignore_eos", "cuda_graphs", "preemption", "enable_chunked_prefill",
            "kv_connector_dir")


def engine_arg_names() -> list[str]:
    """What ``-a`` takes for the builtin engine: the EngineSpec fields it lets -a set, and its own keys."""
    return sorted(SPEC_ARGS + OWN_ARGS)
