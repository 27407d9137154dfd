"""kvdiag: KV-cache diagnostics and accuracy checks for LLM inference engines.

``kvdiag.run_check("accuracy", kv_dtypes=["auto", "fp8"])`` runs a check as its command does and returns the
finished run (kvdiag/api.py), or raises ``kvdiag.UserError`` on bad input before any worker starts;
``kvdiag.results`` reads any run directory back as pandas frames.
"""

from kvdiag.errors import UserError  # noqa: F401 - kvdiag.UserError (light: no torch)
from kvdiag.version import __version__  # noqa: F401 - kvdiag.__version__

__all__ = ["UserError", "__version__", "run_check"]


def __getattr__(name: str):
    """``run_check`` on first use: ``import kvdiag`` stays as light as the command line's --help needs."""
    if name == "run_check":
        from kvdiag.api import run_check

        return run_check
    raise AttributeError(f"module 'kvdiag' has no attribute {name!r}")
