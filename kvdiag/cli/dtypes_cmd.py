"""`kvdiag dtypes`: the kv-cache dtypes an engine supports (and, with --check, the support matrix)."""

from __future__ import annotations

import json

import typer

from kvdiag.cli.options import EngineOpt, Format, FormatOpt, KVDtypeOpt


def dtypes(
    engine: EngineOpt = "builtin",
    kv_dtype: KVDtypeOpt = None,
    fmt: FormatOpt = Format.table,
) -> None:
    """List the kv-cache dtypes an engine supports: storage, scale rule, bytes per element."""
    from kvdiag import dtypes as registry
    from kvdiag.cli.common import resolve_kv_dtypes
    from kvdiag.engines.base import engine_dtypes, resolve_engine

    engine = resolve_engine(engine)
    names = resolve_kv_dtypes(engine, kv_dtype) if kv_dtype else engine_dtypes(engine)
    rows = []
    for name in names:
        d = registry.get(name)
        rows.append(d.to_json() if d else {"name": name, "storage": "?", "quant": "?", "scale_rule": "(engine-defined)",
                                           "bytes_per_element": None, "same_as": None, "aliases": []})
    if fmt == Format.json:
        typer.echo(json.dumps({"engine": engine, "kv_dtypes": rows}, indent=2))
        return
    from rich.table import Table

    from kvdiag.report.table import console

    t = Table(title=f"kv-cache dtypes of engine '{engine}'", title_justify="left")
    for col in ("name", "storage", "quant", "bytes/elem", "scale rule", "aliases"):
        t.add_column(col, overflow="fold")
    for r in rows:
        aliases = ", ".join(r["aliases"]) + (f" (= {r['same_as']})" if r["same_as"] else "")
        t.add_row(r["name"], r["storage"], r["quant"], str(r["bytes_per_element"] or "model"), r["scale_rule"],
                  aliases.strip())
    console().print(t)
