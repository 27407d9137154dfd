"""The wake-cycle check's terminal table: one row per kv dtype and sleep level."""

from __future__ import annotations


def mib(n) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def render(run, con) -> None:
    """One row per case (kv dtype x sleep level): its cycles summed up (the least freed, any cycle not restored or
    not identical, the largest logprob change, NaNs), the verdict naming the cycles that failed, or the first finding
    of a case that ran no cycle (skipped, crashed)."""
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.render.cells import fmt_value, status_text
    from kvdiag.render.fit import show

    t = Table(title="wake-cycle per kv dtype and sleep level (memory judged on the cache's device)",
              title_justify="left")
    for col in ("kv dtype", "level", "cycles", "least freed MiB (expected)", "restored", "tokens identical",
                "max |Δ logprob|", "NaN", "verdict"):
        t.add_column(col, justify="left" if col in ("kv dtype", "verdict") else "right",
                     no_wrap=col == "kv dtype", overflow="fold")
    for c in run.cases:
        m, cycles = c.metrics, c.metrics.get("cycles") or []
        level = str(m.get("level", c.params.get("level", "-"))) + (" staged" if m.get("staged") else "")
        if not cycles:
            first = next((f for f in c.findings if f.severity == "error"), c.findings[0] if c.findings else None)
            t.add_row(c.kv_dtype, level, "0", "-", "-", "-", "-", "-",
                      status_text(c.status) + (f" {escape(first.message[:120])}" if first else ""))
            continue
        freed = min((r["freed_bytes"] for r in cycles if r.get("freed_bytes") is not None), default=None)
        nan = sum((r.get("nonfinite_logprobs") or 0) + (r.get("kv_nonfinite") or 0) + (r.get("kv_bad_scales") or 0)
                  for r in cycles)
        bad = [f"c{r['cycle']}: {', '.join(r['problems'])}" for r in cycles if r.get("problems")]
        t.add_row(c.kv_dtype, level, str(len(cycles)), f"{mib(freed)} ({mib(m.get('expected_bytes'))})",
                  _all_yes(cycles, "restored"), _all_yes(cycles, "identical"),
                  fmt_value(max((r.get("max_dlogprob") or 0.0) for r in cycles)), str(nan),
                  status_text(c.status) + (f" {escape('; '.join(bad))}" if bad else ""))
    show(con, t)


def _all_yes(cycles: list[dict], key: str) -> str:
    """yes, or the cycles where not."""
    no = [str(r["cycle"]) for r in cycles if not r.get(key)]
    return "yes" if not no else f"[red]no (cycle {', '.join(no)})[/]"
