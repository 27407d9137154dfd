"""kvdiag's version, read by the build (pyproject.toml) and recorded in every run.json."""

__version__ = "0.1.0"
