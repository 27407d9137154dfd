"""Exceptions that map to kvdiag's exit codes (see docs/DESIGN.md, "Results and exit codes")."""

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class UserError(Exception):
    """Bad input: kvdiag prints ``kvdiag: error: <message>`` on one line and exits 2."""


class EngineUnsupported(Exception):
    """The engine refuses something it cannot do here (a dtype, sleep mode, KV access).

    The message is the engine's own words; checks turn it into a ``skipped`` or
    ``unsupported`` result rather than a failure.
    """
