"""kvdiag: KV-cache diagnostics and accuracy checks for LLM inference engines."""

__version__ = "0.1.0"
