"""The `kvdiag ci` config: a TOML file (kvdiag.toml) or the [tool.kvdiag] table of a pyproject.toml.

Top-level keys set defaults for every check; a table per check ([memleak], [accuracy],
[wake-cycle], [poison], [dtypes]) turns that check on and may override them. Every
mistake (TOML syntax, unknown key, bad value) is a ConfigError naming the file and line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvdiag.checks.registry import _bool, _choice, _int, _list, _num, _str, _table
from kvdiag.errors import UserError


class ConfigError(UserError):
    pass


# Keys every check section may set (defaults at top level).
COMMON = {
    "engines": _list(_str), "models": _list(_str), "kv_dtypes": _list(_str), "device": _str,
    "engine_args": _table, "timeout": _num(1), "isolate": _choice("case", "run"),
}
TOP = {**COMMON, "engine": _str, "model": _str, "jobs": _int(1), "output_dir": _str, "baseline": _str,
       "compare": _table}
COMPARE = {"max_drop": _num(0), "alpha": _num(0, 1), "mem_tolerance_mib": _num(0)}
ALIASES = {"engine": "engines", "model": "models", "kv_dtype": "kv_dtypes"}


def check_schemas() -> dict:
    """Check name -> {key: validator} of its own options: every check of the registry (kvdiag's and plug-ins')."""
    from kvdiag.checks.registry import checks, toml_schema

    return {name: toml_schema(c) for name, c in checks().items()}


def _alias(raw: str, names) -> str:
    """A table or key as written -> its name: wake_cycle -> wake-cycle, kv_dtype -> kv_dtypes."""
    dashed = raw.replace("_", "-")
    return ALIASES.get(raw) or (dashed if dashed in names and raw not in names else raw)


@dataclass
class CheckConfig:
    name: str
    table: str  # the table's name as written ("wake_cycle" or "wake-cycle"), for error lines
    settings: dict  # COMMON keys (merged with the top level) + the check's own keys


@dataclass
class CIConfig:
    path: Path
    checks: list[CheckConfig]
    jobs: int | None = None  # None: every command's default on its cases (scheduling.gpu_jobs)
    output_dir: str | None = None
    baseline: str | None = None
    compare: dict = field(default_factory=dict)
    lines: dict = field(default_factory=dict)  # (table, key) -> line
    prefix: tuple = ()

    def error(self, message: str, table: str | None = None, key: str | None = None) -> ConfigError:
        line = (self.lines.get((table, key)) or self.lines.get((None, key)) or self.lines.get((table, None))
                or self.lines.get((None, table)))
        return ConfigError(f"{self.path}:{line}: {message}" if line else f"{self.path}: {message}")

    def resolve(self, value: str) -> str:
        """A path in the config is relative to the config file's folder."""
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else self.path.parent / p)


def find_config(cwd: Path | None = None) -> Path:
    cwd = Path(cwd or ".")
    if (cwd / "kvdiag.toml").is_file():
        return cwd / "kvdiag.toml"
    py = cwd / "pyproject.toml"
    if py.is_file() and re.search(r"^\s*\[tool\.kvdiag[\].]", py.read_text(errors="replace"), re.M):
        return py
    raise UserError("no config: pass --config FILE, or put kvdiag.toml (or [tool.kvdiag] in pyproject.toml) "
                    "in the current folder")


def load_config(path: Path) -> CIConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config '{path}': {getattr(e, 'strerror', None) or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column \d+\)", str(e))
        msg = re.sub(r"\s*\(at (line .*|end of document)\)$", "", str(e))
        line = m.group(1) if m else max(1, len(text.splitlines()))  # "at end of document": the last line
        raise ConfigError(f"{path}:{line}: bad TOML: {msg} (the file ends inside it)" if not m
                          else f"{path}:{line}: bad TOML: {msg}") from None
    prefix = ("tool", "kvdiag") if path.name == "pyproject.toml" else ()
    for part in prefix:
        data = data.get(part, {})
    if prefix and not data:
        raise UserError(f"{path} has no [tool.kvdiag] table")
    cfg = CIConfig(path=path, checks=[], lines=key_lines(text, prefix), prefix=prefix)
    top = _validate(cfg, None, data, TOP, sections=True)
    cfg.jobs = top.get("jobs")
    cfg.output_dir = cfg.resolve(top["output_dir"]) if "output_dir" in top else None
    cfg.baseline = cfg.resolve(top["baseline"]) if "baseline" in top else None
    cfg.compare = _validate(cfg, "compare", top.get("compare", {}), COMPARE)
    defaults = {k: v for k, v in top.items() if k in COMMON}
    schemas = check_schemas()
    for raw, section in data.items():
        name = _alias(raw, schemas)
        if name not in schemas:
            continue
        own = _validate(cfg, raw, section, {**COMMON, **schemas[name], "enabled": _bool})
        if own.pop("enabled", True):
            cfg.checks.append(CheckConfig(name, raw, {**defaults, **own}))
    if not cfg.checks:
        raise cfg.error(f"no check to run: add a table for at least one of {', '.join(schemas)}")
    return cfg


def _validate(cfg: CIConfig, table: str | None, data, schema: dict, sections: bool = False) -> dict:
    if not isinstance(data, dict):
        raise cfg.error(f"'{table}' must be a table ([{table}])", None, table)
    out = {}
    checks = check_schemas() if sections else {}
    for raw, value in data.items():
        key = ALIASES.get(raw, raw) if raw not in schema else raw
        if sections and _alias(raw, checks) in checks:
            continue
        if key not in schema:
            valid = sorted(set(schema) | set(checks))
            raise cfg.error(f"unknown key '{raw}'" + (f" in [{table}]" if table else "") + "; valid: "
                            + ", ".join(valid), table, raw)
        try:
            out[key] = schema[key](value)
        except ValueError as e:
            raise cfg.error(f"'{raw}' = {value!r}: expected {e}", table, raw) from None
    return out


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*("[^"]*"|'[^']*'|[A-Za-z0-9_-]+)\s*=""")


def key_lines(text: str, prefix: tuple = ()) -> dict:
    """(table, key) -> 1-based line of each key, and (table, None) -> line of each table header.

    ``table`` is the check section's name under ``prefix`` (None for the top level); other tables are ignored.
    """
    out: dict = {}
    table: str | None = None
    inside = not prefix
    for lineno, line in enumerate(text.splitlines(), 1):
        h = _HEADER.match(line)
        if h:
            parts = tuple(p.strip().strip("\"'") for p in h.group(1).split("."))
            inside = parts[:len(prefix)] == prefix
            rest = parts[len(prefix):]
            table = rest[0] if inside and rest else None
            if inside and rest:
                out.setdefault((table, None), lineno)
            continue
        k = _KEY.match(line)
        if k and inside:
            out.setdefault((table, k.group(1).strip("\"'")), lineno)
    return out
