"""What every terminal table is made of: the console, how values and statuses read, and the cases table any
run can show, and the warning lines under a table. Below every check and report module."""

from __future__ import annotations

STATUS_STYLE = {"pass": "green", "unsupported": "yellow", "skipped": "yellow", "fail": "red", "error": "red",
                "crashed": "bold red", "timeout": "bold red"}


VERDICTS = ("pass", "fail")  # a case with one: its infos are printed under its table, not in its row


def console(stderr: bool = False):
    """Rich console; when not a terminal (CI logs, pipes) and COLUMNS is not set, a wide fixed width instead of 80."""
    import os
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160
    return Console(highlight=False, soft_wrap=False, width=width, stderr=stderr)


def fmt_value(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.3e}"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt_value(x) for x in v[:4]) + ("…" if len(v) > 4 else "")
    return "-" if v is None else str(v)


def status_text(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, '')}]{status}[/]"


def cases_table(cases, title: str = "cases", metrics: list[str] | None = None):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("case")
    t.add_column("status")
    for m in metrics or []:
        t.add_column(m, justify="right")
    t.add_column("time", justify="right")
    t.add_column("first finding", overflow="fold", max_width=70)
    for c in cases:
        first = next((f for f in c.findings if f.severity == "error"), c.findings[0] if c.findings else None)
        t.add_row(c.id, status_text(c.status), *[fmt_value(c.metrics.get(m)) for m in metrics or []],
                  f"{c.duration_s:.1f}s", first.message if first else "")
    return t


def incomplete(run) -> str:
    """What a merged run of `kvdiag ci --shard` lacks ("shards 3, 4 of 4 missing"), or ""."""
    missing = (run.shard or {}).get("missing")
    return f"shards {', '.join(map(str, missing))} of {run.shard['count']} missing" if missing else ""


COMMON_VERSIONS = ("kvdiag", "torch", "device", "driver")


def run_versions(run) -> dict[str, str]:
    """What a report says the run ran on: kvdiag, torch, the device and driver, then each engine's own versions
    (its ``report_versions``: kvdiag.engines.base.reported_versions)."""
    from kvdiag.engines.base import reported_versions

    env = run.environment or {}
    out = {k: str(env[k]) for k in COMMON_VERSIONS if env.get(k)}
    for engine in dict.fromkeys(c.engine for c in run.cases):
        out.update(reported_versions(engine, env))
    return out


def warning_lines(cases, severities: tuple[str, ...] = ("warning",)) -> list[str]:
    """One line per warning (kind and words), with the dtypes that have it: what the tables cannot say (a context
    cut to the engine's length, a drift that did not read the cache, a dtype that stores the model's precision);
    ``severities`` adds others (poison: the info that its waves were sized for other blocks)."""
    seen: dict[tuple[str, str, str], list[str]] = {}
    for c in cases:
        for f in c.findings:
            if f.severity in severities:
                seen.setdefault((f.severity, f.kind, f.message), []).append(c.kv_dtype)
    return [f"{sev} ({', '.join(dtypes)}): {kind}: {msg}" for (sev, kind, msg), dtypes in seen.items()]
