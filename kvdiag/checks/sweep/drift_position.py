"""Drift by position: KL and top-1 agreement per position bucket of a scored continuation, and when it grows.

Buckets are powers of two over the 1-based position of a token in its continuation: 1-16, 17-32, 33-64,
65-128, 129-256, ... (the first holds ``FIRST`` positions, each later one twice the one before). A bucket's
mean KL and top-1 agreement are over every prompt's positions in it (``checks/sweep/drift.py: compare`` gives each
position's). A loss that grows with the length of what the cache holds shows as a mean KL rising from bucket
to bucket, even where the totals over all positions pass.

Growth (``grows``; the accuracy and dtypes checks make it a ``drift_grows`` warning): among the buckets that
hold at least ``MIN_POSITIONS`` positions, the last one's mean KL is more than ``GROWTH`` times the first
one's and above the dtype's mean-KL limit (its family's, or ``--max-kl``). A section with fewer than two such
buckets is not judged; a NaN KL is never growth (the drift limits already fail it).
"""

from __future__ import annotations

from kvdiag.render.svg import line_chart

FIRST = 16  # positions in the first bucket
GROWTH = 4.0  # the last bucket's mean KL over the first's that counts as growing
MIN_POSITIONS = 8  # a bucket with fewer positions is too noisy to judge


def bucket_of(position: int) -> int:
    """The bucket of a 1-based position: 0 for 1-16, 1 for 17-32, 2 for 33-64, ..."""
    return ((position - 1) // FIRST).bit_length()


def bounds(bucket: int) -> tuple[int, int]:
    """The first and last position of a bucket (1-based, both included)."""
    return (1, FIRST) if bucket == 0 else (FIRST * 2 ** (bucket - 1) + 1, FIRST * 2 ** bucket)


def buckets(kls: list[list[float]], agree: list[list[bool]]) -> list[dict]:
    """Rows ``{"from", "to", "positions", "mean_kl", "max_kl", "top1_agreement"}``, one per bucket from the first to
    the last one any continuation reaches; ``kls[i][j]`` and ``agree[i][j]`` are prompt i's at position j + 1."""
    sums: list[list] = []
    for kl_row, agree_row in zip(kls, agree):
        for j, (kl, ok) in enumerate(zip(kl_row, agree_row)):
            b = bucket_of(j + 1)
            while len(sums) <= b:
                sums.append([0, 0.0, float("-inf"), 0])
            s = sums[b]
            s[0], s[1], s[3] = s[0] + 1, s[1] + kl, s[3] + bool(ok)
            if s[2] == s[2]:  # a NaN sticks
                s[2] = kl if kl != kl else max(s[2], kl)
    nan = float("nan")
    return [{"from": bounds(b)[0], "to": bounds(b)[1], "positions": n,
             "mean_kl": total / n if n else nan, "max_kl": top if n else nan,
             "top1_agreement": agreed / n if n else nan}
            for b, (n, total, top, agreed) in enumerate(sums)]


def grows(rows: list[dict], limit: float) -> dict | None:
    """How KL grows over ``rows`` (``buckets``) when it grows as the module says, else None: the first and last
    judged buckets (``first``, ``last``: ``"1-16"``), their mean KL and the ratio (None when the first's is 0)."""
    judged = [r for r in rows if r["positions"] >= MIN_POSITIONS]
    if len(judged) < 2:
        return None
    a, b = judged[0], judged[-1]
    first, last = a["mean_kl"], b["mean_kl"]
    if not (last > GROWTH * first and last > limit):  # False for NaN
        return None
    return {"first": label(a), "last": label(b), "first_kl": first, "last_kl": last,
            "ratio": last / first if first > 0 else None}


def label(row: dict) -> str:
    return f"{row['from']}-{row['to']}"


SECTION_TITLES = {"prompts": "the prompts' continuations", "long": "the long continuations",
                  "decoded": "each dtype's decoded continuations"}


def position_plots(cases, suffix: str = "") -> list[str]:
    """Per scored section, each dtype's mean KL per position bucket divided by its first bucket's (a dtype with no
    KL in its first bucket has no line: the table in the report shows it), and the growth threshold: a line that
    rises is a loss growing with the length of what the cache holds."""
    from kvdiag.checks.sweep.drift_position import GROWTH

    judged = [(c.kv_dtype, c.metrics["drift"]["by_position"]) for c in cases
              if (c.metrics.get("drift") or {}).get("by_position")]
    out = []
    for section in dict.fromkeys(s for _, by in judged for s in by):
        spans = sorted({(b["from"], b["to"]) for _, by in judged for b in by.get(section, ())})
        series = {}
        for dtype, by in judged:
            at = {(b["from"], b["to"]): b for b in by.get(section, ()) if b.get("positions")}
            first = at.get(spans[0], {}).get("mean_kl")
            if isinstance(first, (int, float)) and first > 0:
                series[dtype] = [at[s]["mean_kl"] / first if s in at else None for s in spans]
        if series:
            series[f"{GROWTH:g}x (threshold)"] = [GROWTH] * len(spans)
            out.append(line_chart(f"drift by position along {SECTION_TITLES.get(section, section)}{suffix}",
                                  f"mean KL / mean KL at {spans[0][0]}-{spans[0][1]}", [f"{a}-{b}" for a, b in spans],
                                  series, xlabel="token positions (bucket)"))
    return out


SECTION_NAMES = {"prompts": "prompts", "long": "long continuation", "decoded": "decoded continuation"}


def position_table(rows: list[dict] | None, suffix: str) -> list:
    """The drift-by-position table (one row per dtype and scored section, a column per position bucket, each cell
    ``mean KL / top-1``), as a one-element list; [] when the analysis has none."""
    from kvdiag.checks.sweep.drift_position import GROWTH

    if not rows:
        return []
    spans = sorted({(b["from"], b["to"]) for r in rows for sec in r["by_position"].values() for b in sec})
    body = []
    for r in rows:
        for section, buckets in r["by_position"].items():
            at = {(b["from"], b["to"]): b for b in buckets}
            g = (r.get("grows") or {}).get(section)
            body.append([r["kv_dtype"], SECTION_NAMES.get(section, section)]
                        + [_bucket_cell(at.get(span)) for span in spans] + [_grows_cell(g)])
    title = (f"Drift by position{suffix} vs the baseline dtype: mean KL / top-1 agreement per bucket of token "
             f"positions (drift_grows: the last bucket's KL > {GROWTH:g}x the first's and above the dtype's limit)")
    return [(title, ("kv dtype", "scored") + tuple(f"{a}-{b}" for a, b in spans) + ("KL grows",), body)]


def _bucket_cell(b: dict | None) -> str:
    if not b or not b.get("positions"):
        return "-"
    kl = b["mean_kl"]
    return f"{'0' if kl == 0 else f'{kl:.2g}'} / {b['top1_agreement']:.3f}"


def _grows_cell(g: dict | None) -> str:
    if not g:
        return "no"
    return "yes, " + (f"{g['ratio']:.1f}x" if g.get("ratio") is not None else "from 0")
