"""What a check declares: its params (a dataclass of :func:`option` fields, each default written once) and its
:class:`Check` entry, whose ``module:function`` fields name what the worker runs and what the parent renders. A
check's folder imports only this from the registry's side, so the registry's list of checks points down at them and
nothing points back up. Nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def option(default, *flags: str, help: str = "", min: float | None = None, max: float | None = None,
           choices: tuple | None = None, toml: str | None = None):
    """A field of a check's params: its default, its command-line flags (default ``--field-name``), its help, its
    bounds or choices (checked on the command line and in the config), and its config key (default: the name)."""
    meta = {"flags": flags, "help": help, "min": min, "max": max, "choices": choices, "toml": toml}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Check:
    name: str  # the command and the config table: "wake-cycle"
    target: str  # "module:function(case, ctx)" run in the worker for one case
    params: type  # a dataclass of option() fields
    help: str = ""  # the command's --help: its first line is the summary
    variants: str | None = None  # "module:function(params) -> [dict]": cases per dtype (wake-cycle: its levels)
    analyze: str | None = None  # "module:function(run, params)": the verdict across cases, into run.analysis
    render: str | None = None  # "module:function(run, console)": the terminal table (default: the cases table)
    plots: str | None = None  # "module:function(cases, title_suffix) -> [svg]" for report.html
    compare: str | None = None  # "module:function(old_case, new_case, settings) -> [row]" for kvdiag compare
    tables: str | None = None  # "module:function(run) -> [(title, header, rows)]": its tables in report.md/html
    cases: str | None = None  # "module:function(target, params) -> (cases, analyze)" when not one case per dtype and
    # variant (accuracy, dtypes: a sweep against a baseline dtype; kvdiag.checks.cases)
    spread: str | None = None  # "module:function(case) -> case": a case as the scheduler must place it (paths: the
    # engine args of a path that spans GPUs, or why it cannot run here), before any worker starts
    kv_dtypes: tuple[str, ...] | None = None  # its kv dtypes when the user names none (those the engine has);
    # None: the engine's whole sweep
    gpu_share: bool = False  # its builtin-engine cases may share a GPU (it measures no device memory; scheduling)
    isolate: bool = True  # takes --isolate (memleak: every dtype always in its own worker)
    timeout: float = 900.0  # seconds a case may run
    selftest: dict | None = None  # the params of its `kvdiag selftest` cases: small sizes that keep it short
    reproducer: str | None = None  # "module:function(case, run) -> str | None": a failing case's standalone script
    # (kvdiag.proof), None where it has none

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
