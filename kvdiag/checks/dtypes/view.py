"""The dtypes check's terminal table: the support matrix, one row per kv dtype."""

from __future__ import annotations

STYLE = {"pass": "green", "unsupported": "yellow", "resource": "red", "crashed": "bold red", "wrong": "bold red"}


def render(run, con) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.render.cells import fmt_value
    from kvdiag.render.fit import show

    a = run.analysis.get("dtypes", {})
    t = Table(title=f"kv dtype support matrix of engine '{run.cases[0].engine if run.cases else '?'}' "
              f"(drift vs '{a.get('baseline')}')", title_justify="left")
    for col in ("kv dtype", "result", "starts", "finite", "== auto", "KL mean", "top-1", "stores",
                "K+V (+scales) B/token", "layers (kind, dtype, size)", "detail"):
        t.add_column(col, overflow="fold", max_width=70 if col == "detail" else None, no_wrap=col == "kv dtype")
    for r in a.get("rows", []):
        t.add_row(r["kv_dtype"], f"[{STYLE.get(r['result'], '')}]{r['result']}[/]", _yn(r["started"]),
                  _yn(r["finite"]), _yn(r["identical_to_auto"]), fmt_value(r["mean_kl"]),
                  fmt_value(r["top1_agreement"]), _stores(r), _token_bytes(r), escape(r.get("layers") or "-"),
                  escape(r["detail"] or ""))
    show(con, t)


def _stores(r: dict) -> str:
    from rich.markup import escape

    stores = r.get("stores")
    return "-" if stores is None else escape(stores) if not r.get("not_quantized") else f"[yellow]{escape(stores)}[/]"


def _token_bytes(r: dict) -> str:
    """K+V bytes per token over all layers, and the scales' (``+N``) where there are per-token scales."""
    kv, scales = r.get("kv_bytes_per_token"), r.get("scale_bytes_per_token")
    return "-" if kv is None else f"{kv}" + (f" +{scales}" if scales else "")


def _yn(v) -> str:
    return "-" if v is None else ("yes" if v else "no")
