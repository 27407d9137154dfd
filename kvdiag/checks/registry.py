"""The checks kvdiag knows: each check module declares one ``Check``; plug-ins add theirs under the
``kvdiag.checks`` entry point (``name = "package.module:CHECK"``) or with :func:`register`.

A check's ``params`` is a dataclass whose fields are its options, each default written once. From it come the
check's command-line options (a plug-in without a command of its own gets one: ``kvdiag NAME``), the keys and
validation of its ``kvdiag ci`` table, and the params its cases carry into the worker. The other fields name, as
``module:function``, what the worker runs for one case and what the parent does with the results: the cross-case
verdict, the terminal table, the plots of report.html and the rules of ``kvdiag compare``. Nothing here imports
torch: ``kvdiag --help`` and the config check stay instant.
"""

from __future__ import annotations

import importlib
import typing
from dataclasses import MISSING, dataclass, field, fields

ENTRY_POINT_GROUP = "kvdiag.checks"
BUILTIN = ("kvdiag.checks.accuracy:CHECK", "kvdiag.checks.dtypes_matrix:CHECK", "kvdiag.checks.memleak:CHECK",
           "kvdiag.checks.wake_cycle:CHECK", "kvdiag.checks.poison:CHECK")


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
    cases: str | None = None  # "module:function(target, params) -> (cases, analyze)" when not one case per dtype and
    # variant (accuracy, dtypes: a sweep against a baseline dtype; kvdiag.run.cases)
    gpu_share: bool = False  # its builtin-engine cases may share a GPU (it measures no device memory; scheduling)
    isolate: bool = True  # takes --isolate (memleak: every dtype always in its own worker)
    timeout: float = 900.0  # seconds a case may run
    selftest: dict | None = None  # the params of its `kvdiag selftest` cases: small sizes that keep it short

    def option_fields(self) -> list:
        """The fields made with option(); other fields are the worker's own (selftest's sizes)."""
        return [f for f in fields(self.params) if "flags" in f.metadata]

    def make(self, values: dict):
        """The params from config or command-line values (missing keys keep their defaults)."""
        names = {f.name for f in fields(self.params)}
        return self.params(**{k: v for k, v in values.items() if k in names})


def load(ref: str):
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


_EXTRA: dict[str, Check] = {}
_CACHE: dict[str, Check] = {}


def register(check: Check) -> Check:
    """Add a check (a plug-in, a test's toy check) for this process."""
    _EXTRA[check.name] = check
    _CACHE.clear()
    return check


def checks() -> dict[str, Check]:
    """Every check: kvdiag's own, then the entry point's, then those registered in this process."""
    if not _CACHE:
        found = [load(ref) for ref in BUILTIN]
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                found.append(ep.load())
            except Exception as e:  # noqa: BLE001 - a broken plug-in must not break kvdiag
                import sys

                print(f"kvdiag: warning: check plug-in '{ep.name}' ({ep.value}) not loaded: {e}", file=sys.stderr)
        found += list(_EXTRA.values())
        for c in found:
            _CACHE.setdefault(c.name, c)
    return dict(_CACHE)


def get(name: str) -> Check | None:
    return checks().get(name)


# ------------------------------------------------------------------ config values (kvdiag ci)

def validator(f, hint):
    """The config check of one params field, from its type and its bounds or choices."""
    meta = f.metadata
    base, _ = _unwrap(hint)
    one = _choice(*meta["choices"]) if meta.get("choices") else None
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base) or (str,)
        return _list(one or _scalar(item, meta))
    return one or _scalar(base, meta)


def toml_schema(check: Check) -> dict:
    """Config key -> validator of every option of ``check``."""
    h = typing.get_type_hints(check.params)
    return {f.metadata.get("toml") or f.name: validator(f, h[f.name]) for f in check.option_fields()}


def default_of(f):
    return f.default_factory() if f.default is MISSING else f.default


def _unwrap(hint):
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def _scalar(t, meta):
    lo, hi = meta.get("min"), meta.get("max")
    if t is bool:
        return _bool
    if t is int:
        return _int(lo, hi)
    if t is float:
        return _num(lo, hi)
    return _str


def _int(lo=None, hi=None):
    def check(v):
        if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"an integer{'' if lo is None else f' >= {lo:g}'}")
        return v
    return check


def _num(lo=None, hi=None):
    def check(v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or (lo is not None and v < lo) or \
                (hi is not None and v > hi):
            raise ValueError("a number" + (f" in [{lo:g}, {hi:g}]" if hi is not None else f" >= {lo:g}"
                                           if lo is not None else ""))
        return float(v)
    return check


def _str(v):
    if not isinstance(v, str) or not v.strip():
        raise ValueError("a non-empty string")
    return v


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError("true or false")
    return v


def _list(item):
    def check(v):
        values = [v] if not isinstance(v, list) else v
        try:
            return [item(x) for x in values]
        except ValueError as e:
            raise ValueError(f"a list of {e}") from None
    return check


def _choice(*choices):
    def check(v):
        if v not in choices:
            raise ValueError("one of " + ", ".join(map(str, choices)))
        return v
    return check


def _table(v):
    if not isinstance(v, dict):
        raise ValueError("a table of key = value")
    return v
