"""Small self-contained SVG charts (no plotting library, no scripts): bars with intervals, lines."""

from __future__ import annotations

import math
from html import escape

PALETTE = ["#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5", "#9c6b4e"]
W, H, L, R, T, B = 640, 300, 64, 16, 28, 70


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), default=raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 2) if start + i * step <= hi + 1e-12]


def _frame(title: str, ylabel: str, lo: float, hi: float) -> tuple[list[str], callable]:
    ticks = _ticks(lo, hi)
    lo, hi = min(lo, ticks[0]), max(hi, ticks[-1])
    y = lambda v: T + (H - T - B) * (1 - (v - lo) / ((hi - lo) or 1))  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
             f'role="img" class="plot"><title>{escape(title)}</title>',
             f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">{escape(title)}</text>',
             f'<text x="12" y="{(T + H - B) / 2}" font-size="11" transform="rotate(-90 12 {(T + H - B) / 2})" '
             f'text-anchor="middle">{escape(ylabel)}</text>']
    for t in ticks:
        parts.append(f'<line x1="{L}" x2="{W - R}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#ddd"/>'
                     f'<text x="{L - 4}" y="{y(t) + 4:.1f}" font-size="10" text-anchor="end">{t:.4g}</text>')
    return parts, y


def _finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def bar_chart(title: str, ylabel: str, bars: list[tuple[str, float, float | None, float | None]]) -> str:
    """bars: (label, value, low, high); low/high draw an interval (None: no interval)."""
    vals = _finite([b[1] for b in bars] + [b[2] for b in bars if b[2] is not None]
                   + [b[3] for b in bars if b[3] is not None]) or [0.0, 1.0]
    parts, y = _frame(title, ylabel, min(0.0, min(vals)), max(vals))
    slot = (W - L - R) / max(1, len(bars))
    for i, (label, v, lo, hi) in enumerate(bars):
        x = L + i * slot + slot * 0.15
        w = slot * 0.7
        if isinstance(v, (int, float)) and math.isfinite(v):
            top, base = y(max(v, 0)), y(min(v, 0))
            parts.append(f'<rect x="{x:.1f}" y="{top:.1f}" width="{w:.1f}" height="{max(base - top, 0.5):.1f}" '
                         f'fill="{PALETTE[i % len(PALETTE)]}"><title>{escape(label)}: {v:.4g}</title></rect>')
        else:
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y(0) - 4:.1f}" font-size="11" text-anchor="middle" '
                         f'fill="#c00">NaN</text>')
        if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
            cx = x + w / 2
            parts.append(f'<path d="M{cx:.1f} {y(lo):.1f}V{y(hi):.1f}M{cx - 5:.1f} {y(lo):.1f}h10'
                         f'M{cx - 5:.1f} {y(hi):.1f}h10" stroke="#222" fill="none"/>')
        parts.append(f'<text x="{x + w / 2:.1f}" y="{H - B + 14}" font-size="10" text-anchor="end" '
                     f'transform="rotate(-30 {x + w / 2:.1f} {H - B + 14})">{escape(label)}</text>')
    return "".join(parts) + "</svg>"


def line_chart(title: str, ylabel: str, xlabels: list[str], series: dict[str, list[float | None]]) -> str:
    """One line per series over shared x labels (e.g. cycle/stage), with a legend."""
    vals = _finite([v for s in series.values() for v in s]) or [0.0, 1.0]
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.1 or max(abs(hi) * 0.1, 1.0)
    parts, y = _frame(title, ylabel, lo - pad, hi + pad)
    n = max(1, len(xlabels) - 1)
    x = lambda i: L + (W - L - R) * i / n  # noqa: E731
    for i, label in enumerate(xlabels):
        parts.append(f'<text x="{x(i):.1f}" y="{H - B + 14}" font-size="10" text-anchor="end" '
                     f'transform="rotate(-30 {x(i):.1f} {H - B + 14})">{escape(label)}</text>')
    for k, (name, values) in enumerate(series.items()):
        color = PALETTE[k % len(PALETTE)]
        pts = [(x(i), y(v)) for i, v in enumerate(values) if isinstance(v, (int, float)) and math.isfinite(v)]
        if pts:
            d = "M" + "L".join(f"{px:.1f} {py:.1f}" for px, py in pts)
            parts.append(f'<path d="{d}" stroke="{color}" stroke-width="2" fill="none"/>')
            parts += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>' for px, py in pts]
        lx, ly = L + 8 + (k % 4) * 140, H - 26 + (k // 4) * 12
        parts.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{ly + 1}" font-size="10">{escape(name)}</text>')
    return "".join(parts) + "</svg>"
