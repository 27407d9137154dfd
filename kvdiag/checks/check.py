"""What a check declares: its params (a dataclass of :func:`option` fields, each default written once) and its
:class:`Check` subclass, whose methods are what the worker runs and what the parent renders. A check's folder
imports only this from the registry's side, so the registry's list of checks points down at them and nothing points
back up. Nothing here imports torch."""

from __future__ import annotations

from dataclasses import field, fields


def option(default, *flags: str, help: str = "", min: float | None = None, max: float | None = None,
           choices: tuple | None = None, toml: str | None = None):
    """A field of a check's params: its default, its command-line flags (default ``--field-name``), its help, its
    bounds or choices (checked on the command line and in the config), and its config key (default: the name)."""
    meta = {"flags": flags, "help": help, "min": min, "max": max, "choices": choices, "toml": toml}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


class Check:
    """A check: subclass it, set the class attributes below and write ``run``; each method imports its module inside
    its body, so that importing a check's folder (every ``kvdiag --help``, the config check) imports no torch.

    A method a check lacks is this class's ``None``: not provided. Then the caller does without it: one case per kv
    dtype and variant (``cases``), one variant (``variants``), the worker's verdicts (``analyze``), the cases table
    (``render``), no plots, tables, compare rows or reproducer, and the case placed as it is (``spread``).
    The registry (``kvdiag.checks.registry``) holds one instance of each check."""

    name: str  # the command and the config table: "wake-cycle"
    params: type  # a dataclass of option() fields
    help = ""  # the command's --help: its first line is the summary
    kv_dtypes: tuple[str, ...] | None = None  # its kv dtypes when the user names none (those the engine has);
    # None: the engine's whole sweep
    gpu_share = False  # its builtin-engine cases may share a GPU (it measures no device memory; scheduling)
    isolate = True  # takes --isolate (memleak: every dtype always in its own worker)
    timeout = 900.0  # seconds a case may run
    selftest: dict | None = None  # the params of its `kvdiag selftest` cases: small sizes that keep it short
    observes: frozenset[str] = frozenset()  # what it can see move (kvdiag.engines.selftest.OBSERVATIONS): the
    # self-test runs a fault's cases in the checks its catalogue names and calls n/a those that observe none of
    # what the fault moves

    # Optional methods; None: not provided (above: what is done instead).
    cases = None  # (target, params) -> (cases, analyze) when not one case per dtype and variant (accuracy, dtypes:
    # a sweep against a baseline dtype; kvdiag.checks.cases)
    variants = None  # (params) -> [dict]: cases per dtype (wake-cycle: its levels), each with its "suffix"
    analyze = None  # (run, params): the verdict across cases, into run.analysis
    render = None  # (run, console): the terminal table
    plots = None  # (cases, title_suffix) -> [svg] for report.html
    tables = None  # (run) -> [(title, header, rows)]: its tables in report.md/html
    compare = None  # (old_case, new_case, settings) -> [row] for kvdiag compare
    spread = None  # (case) -> case: a case as the scheduler must place it (paths: the engine args of a path that
    # spans GPUs, or why it cannot run here), before any worker starts
    reproducer = None  # (case, run) -> str | None: a failing case's standalone script (kvdiag.proof)

    def run(self, case, ctx):
        """One case in the worker (``case.params`` holds its options): its ``CaseResult``."""
        raise NotImplementedError(f"check '{self.name}' has no run()")

    @property
    def judged_at_end(self) -> bool:
        """Whether the run decides its cases' verdicts across cases, after they ran (against a baseline dtype, a
        reference case): a worker's record of such a case is not yet its verdict (``metrics.judged_later``)."""
        return bool(self.analyze or self.cases)

    def option_fields(self) -> list:
        """The fields made with option(); other fields are the worker's own (selftest's sizes)."""
        return [f for f in fields(self.params) if "flags" in f.metadata]

    def make(self, values: dict):
        """The params from config or command-line values (missing keys keep their defaults)."""
        names = {f.name for f in fields(self.params)}
        return self.params(**{k: v for k, v in values.items() if k in names})
