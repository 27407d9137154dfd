"""The checks kvdiag knows: each check folder declares one :class:`Check` subclass; plug-ins add theirs under the
``kvdiag.checks`` entry point (``name = "package.module:CheckClass"``) or with :func:`register`.

A check's ``params`` is a dataclass whose fields are its options, each default written once. From it come the
check's command-line options (a plug-in without a command of its own gets one: ``kvdiag NAME``), the keys and
validation of its ``kvdiag ci`` table, and the params its cases carry into the worker. Its methods are what the
worker runs for one case (``run``, found here by the case's check name) and what the parent does with the results:
the cross-case verdict, the terminal table, the plots of report.html and the rules of ``kvdiag compare``. Nothing
here imports torch: each method imports its module when called, so ``kvdiag --help`` and the config check stay
instant.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING

from kvdiag.checks.accuracy import Accuracy
from kvdiag.checks.check import Check, option  # noqa: F401 - plug-ins import both from here
from kvdiag.checks.dtypes import Dtypes
from kvdiag.checks.memleak import Memleak
from kvdiag.checks.paths import Paths
from kvdiag.checks.poison import Poison
from kvdiag.checks.wake_cycle import WakeCycle

ENTRY_POINT_GROUP = "kvdiag.checks"
BUILTIN = (Accuracy, Dtypes, Memleak, WakeCycle, Poison, Paths)  # kvdiag's own checks, in the commands' order

_EXTRA: dict[str, Check] = {}
_CACHE: dict[str, Check] = {}


def register(check) -> Check:
    """Add a check (a :class:`Check` subclass or instance) for this process: its command, config table, reports and
    compare rules. Its cases run in fresh workers, which find a check by name among kvdiag's own and the entry
    point's (:func:`run_case`): a check whose cases must run there is a plug-in (the ``kvdiag.checks`` entry
    point)."""
    check = _instance(check)
    _EXTRA[check.name] = check
    _CACHE.clear()
    return check


def _instance(check) -> Check:
    return check() if isinstance(check, type) else check


def checks() -> dict[str, Check]:
    """Every check: kvdiag's own, then the entry point's, then those registered in this process."""
    if not _CACHE:
        found = [c() for c in BUILTIN]
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                found.append(_instance(ep.load()))
            except Exception as e:  # noqa: BLE001 - a broken plug-in must not break kvdiag
                import sys

                print(f"kvdiag: warning: check plug-in '{ep.name}' ({ep.value}) not loaded: {e}", file=sys.stderr)
        found += list(_EXTRA.values())
        for c in found:
            _CACHE.setdefault(c.name, c)
    return dict(_CACHE)


def get(name: str) -> Check | None:
    return checks().get(name)


def run_case(case, ctx):
    """The worker's call for one case: its check's ``run``, the check found by the case's name."""
    check = get(case.check)
    if check is None:
        raise LookupError(f"no check '{case.check}' in this worker; valid: {', '.join(checks())} (a check of a "
                          f"plug-in is found through its entry point '{ENTRY_POINT_GROUP}')")
    return check.run(case, ctx)


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


def _default_dtypes(check: Check, engine: str) -> list[str] | None:
    """The check's own default kv dtypes that the engine has (None: the engine's sweep)."""
    if not check.kv_dtypes:
        return None
    from kvdiag.engines.base import engine_dtypes

    have = engine_dtypes(engine)
    return [d for d in check.kv_dtypes if d in have] or None


def check_cases(name: str, target, p) -> tuple:
    """(cases, analyze) of a registered check (kvdiag.checks.registry) with params ``p``: the check's own builder
    (``Check.cases``: accuracy, dtypes), else one case per kv dtype and variant, each carrying the options in ``p``;
    ``analyze`` is the check's verdict across cases, or None."""
    from kvdiag.checks.cases import engine_model, resolve_faults, resolve_kv_dtypes

    check = get(name)
    if check.cases:
        return check.cases(target, p)
    from kvdiag.case import Case
    from kvdiag.engines.args import parse_engine_args
    from kvdiag.engines.base import check_engine_args, resolve_engine
    from kvdiag.models import label as model_label

    engine = resolve_engine(target.engine)
    model = engine_model(engine, target.model)
    base = {"device": target.device, "engine_args": check_engine_args(engine, parse_engine_args(target.engine_args)),
            "faults": resolve_faults(engine, target.faults),
            **{f.name: getattr(p, f.name) for f in check.option_fields()}}
    variants = check.variants(p) if check.variants else ({"suffix": None},)
    group = name if check.isolate and target.isolate == "run" else None
    cases = []
    for d in resolve_kv_dtypes(engine, target.kv_dtypes or _default_dtypes(check, engine)):
        for v in variants:
            v = dict(v)
            suffix = v.pop("suffix")
            cid = f"{name}/{engine}/{model_label(model)}/{d}" + (f"/{suffix}" if suffix else "")
            case = Case(name, engine, model, d, params={**base, **v}, id=cid, group=group)
            cases.append(check.spread(case) if check.spread else case)
    analyze = (lambda run: check.analyze(run, p)) if check.analyze else None
    return cases, analyze
