"""Drift by position: KL and top-1 agreement per position bucket of a scored continuation, and when it grows.

Buckets are powers of two over the 1-based position of a token in its continuation: 1-16, 17-32, 33-64,
65-128, 129-256, ... (the first holds ``FIRST`` positions, each later one twice the one before). A bucket's
mean KL and top-1 agreement are over every prompt's positions in it (``checks/drift.py: compare`` gives each
position's). A loss that grows with the length of what the cache holds shows as a mean KL rising from bucket
to bucket, even where the totals over all positions pass.

Growth (``grows``; the accuracy and dtypes checks make it a ``drift_grows`` warning): among the buckets that
hold at least ``MIN_POSITIONS`` positions, the last one's mean KL is more than ``GROWTH`` times the first
one's and above the dtype's mean-KL limit (its family's, or ``--max-kl``). A section with fewer than two such
buckets is not judged; a NaN KL is never growth (the drift limits already fail it).
"""

from __future__ import annotations

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
