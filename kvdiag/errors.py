"""Exceptions that map to kvdiag's exit codes (see docs/DESIGN.md, "Results and exit codes")."""

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class UserError(Exception):
    """Bad input: kvdiag prints ``kvdiag: error: <message>`` on one line and exits 2."""


class EngineUnsupported(Exception):
    """The engine refuses something it cannot do here (a dtype, sleep mode, KV access).

    The message is the engine's own words; checks turn it into a ``skipped`` or
    ``unsupported`` result rather than a failure (unless it comes from a resource failure:
    :func:`resource_failure`).
    """


def first_line(exc: BaseException) -> str:
    """An exception's message as one line: its first non-empty line, else the exception's type name."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def raised_in(exc: BaseException) -> str | None:
    """Where ``exc`` was raised: ``path:line (function)`` of its innermost frame, the path as imported (from the
    ``sys.path`` entry it was found under: ``vllm/v1/worker/gpu_model_runner.py:953 (init_fp8_kv_scales)``,
    wherever vLLM is installed); None without a traceback."""
    import sys
    import traceback

    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if not frames:
        return None
    f = frames[-1]
    path = f.filename
    for root in sorted((p for p in sys.path if p), key=len, reverse=True):
        if path.startswith(root.rstrip("/") + "/"):
            path = path[len(root.rstrip("/")) + 1:]
            break
    return f"{path}:{f.lineno} ({f.name})"


# What engines say when the device ran out of memory for them (torch, CUDA, vLLM's memory profiling and KV cache
# sizing), lower case. On a GPU these mostly mean "something else holds the memory" (another engine on the same
# GPU), so they are errors of the run, never an engine refusing a dtype.
RESOURCE_MESSAGES = (
    "out of memory",  # torch.OutOfMemoryError ("CUDA out of memory"), "CUDA error: out of memory"
    "no available memory for the cache blocks",  # vLLM: nothing left for the KV cache after profiling
    "error in memory profiling",  # vLLM: the free memory changed under its profiling (another process)
    "larger than the available kv cache memory",  # vLLM: max_model_len's KV cache does not fit
)


def resource_failure(exc: BaseException | None) -> str | None:
    """``Type: message`` (the line that says so) when ``exc``, or an exception it was raised from or while
    handling, says the device ran out of memory (``RESOURCE_MESSAGES``, torch's OutOfMemoryError, MemoryError);
    else None. A resource failure is an ``error`` with a ``resource`` finding, never ``unsupported``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
        said = [x for x in lines if any(m in x.lower() for m in RESOURCE_MESSAGES)]
        if said or isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return f"{type(exc).__name__}: {(said or lines or ['out of memory'])[0]}"[:500]
        exc = exc.__cause__ or exc.__context__
    return None
