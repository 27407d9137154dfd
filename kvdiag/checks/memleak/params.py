"""The memleak check's options (each default written once: the CLI, the config and the worker read
them from here) and its --help."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvdiag.checks.check import option


@dataclass
class LeakParams:
    cycles: int = option(3, "--cycles", "-n", help="How many cycles to run.", min=1)
    threshold_mib: float | None = option(
        None, "--threshold", min=0, help="Retention limit: MiB that may stay held beyond the baseline after any "
        "shutdown (CUDA allocated/reserved, live tensor bytes; the driver's used memory and NVML get 128 MiB more "
        "for the CUDA runtime's own memory). Default: max(64 MiB, 5% of the engine's peak).")
    max_tokens: int = option(16, "--max-tokens", help="Tokens decoded per prompt in each cycle.", min=1)
    kv_sizes: str | None = option(
        None, "--kv-sizes", help="A,B: run the cycles at two KV cache sizes, A then B blocks of the engine's "
        "block size (builtin: num_blocks; vLLM: num_gpu_blocks_override, with kvdiag's kv_cache_memory_bytes for it "
        "on a GPU), --cycles at each; what survives shutdown in proportion to the cache (its bytes' ratio within "
        "25% of the cache's, on a log scale) fails, with the ratio. Each size must hold the workload (vLLM: "
        "max_model_len tokens). Default: one size, the engine's own.")
    num_prompts: int = 4

    def __post_init__(self):
        self.sizes = parse_kv_sizes(self.kv_sizes)

    @classmethod
    def from_case(cls, case) -> "LeakParams":
        return cls(**{k: case.params[k] for k in asdict(cls()) if case.params.get(k) is not None})


def parse_kv_sizes(text: str | None) -> tuple[int, int] | None:
    """``--kv-sizes A,B`` as two different positive block counts; UserError (exit 2) otherwise."""
    if text is None:
        return None
    from kvdiag.errors import UserError

    parts = [x.strip() for x in str(text).split(",")]
    try:
        sizes = tuple(int(x) for x in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 2 or min(sizes) < 1 or sizes[0] == sizes[1]:
        raise UserError(f"--kv-sizes {text!r}: expected two different positive KV cache sizes in blocks, A,B "
                        "(e.g. 64,128)")
    return sizes


HELP = (
    "Is memory back after the engine shuts down? Per kv dtype, in a fresh worker: a baseline, then\n"
    "--cycles times start, a short prefill + decode, snapshot, shutdown, gc + empty_cache, snapshot.\n"
    "\n"
    "One verdict policy for every engine. FAIL when:\n"
    "retention - after any shutdown (the first too; one cycle is enough) more than --threshold MiB stays held\n"
    "beyond the baseline on CUDA allocated/reserved, the driver's used memory or live tensor bytes; the\n"
    "finding names the holder: Python referrers (a module global, an lru_cache and its key, a closure, a class\n"
    "attribute, the engine object), vLLM's sleep-mode allocator pool, CUDA graph pools, or \"held outside\n"
    "Python objects (allocator/driver)\";\n"
    "growth - memory after shutdown grows in every step from one cycle to the next: by more than 4 MiB on\n"
    "tensor bytes, CUDA allocated or reserved, by more than max(16 MiB, 1% of the peak) on RSS, driver\n"
    "used and NVML;\n"
    "surviving tensors whose count or bytes grow every cycle;\n"
    "the KV cache by identity - any storage of the engine's KV cache or scales (its kv_blocks() view) still\n"
    "alive after shutdown, whatever its size, with its holder;\n"
    "sized by the KV cache - the surviving storages of one holder (a module global, an object) that together\n"
    "reach 1% of the engine's KV cache (a per-token scale, a copy, one tensor per layer): it grows with the\n"
    "cache, so it fails under the retention limit too;\n"
    "shaped by the KV cache - any survivor indexed by the cache's blocks or token slots, whatever its size;\n"
    "proportional to the KV cache (--kv-sizes A,B) - what survives at both sizes in the cache's ratio;\n"
    "restart impossible - the engine started once and cannot start again in this process (vLLM sleep mode\n"
    "on CUDA), with the engine's message;\n"
    "objects left frozen by gc.freeze();\n"
    "processes the engine started (vLLM's workers under tensor parallelism) alive 10 s after shutdown,\n"
    "holding GPU memory or more every cycle. The engine's memory is that of all its processes and GPUs (NVML).\n"
    "WARNING (exit 0): a small set of tensors that survives shutdown unchanged every cycle (a process-lifetime\n"
    "cache), with its holder; the same processes alive after every shutdown, without GPU memory.\n"
    "INFO: a one-time cost of the first cycle under the limits.")
