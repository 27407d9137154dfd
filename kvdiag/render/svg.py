"""Small self-contained SVG charts (no plotting library, no scripts): bars with intervals, lines.

Every chart has a title, a y-axis label and grid, x labels, and (line charts) a legend on the right.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ["#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5", "#9c6b4e"]
H, L, T, B = 340, 70, 30, 104  # height; left, top and bottom margins
LEGEND_W = 170
DASHES = ("6 3", "2 2", "8 3 2 3", "4 4", "1 3")


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), default=raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 2) if start + i * step <= hi + step * 1e-9]


class _Frame:
    """Title, y axis with grid and ticks, the plot area [L, right] x [T, H - B], and an x-axis label."""

    def __init__(self, title: str, ylabel: str, lo: float, hi: float, width: int, right: int, xlabel: str = ""):
        ticks = _ticks(lo, hi)
        self.lo, self.hi = min(lo, ticks[0]), max(hi, ticks[-1])
        self.width, self.right = width, right
        mid = (T + H - B) / 2
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {H}" width="{width}" height="{H}" '
            f'role="img" class="plot" font-family="system-ui, sans-serif"><title>{escape(title)}</title>',
            f'<rect x="0" y="0" width="{width}" height="{H}" fill="#fff"/>',
            f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">'
            f'{escape(title)}</text>',
            f'<text x="14" y="{mid}" font-size="11" transform="rotate(-90 14 {mid})" text-anchor="middle">'
            f'{escape(ylabel)}</text>']
        for t in ticks:
            yy = self.y(t)
            self.parts.append(f'<line x1="{L}" x2="{right}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e5e5e5"/>'
                              f'<text x="{L - 5}" y="{yy + 4:.1f}" font-size="10" text-anchor="end">{t:.4g}</text>')
        self.parts.append(f'<path d="M{L} {T}V{H - B}H{right}" stroke="#888" fill="none"/>')
        if xlabel:
            self.parts.append(f'<text x="{(L + right) / 2}" y="{H - 6}" font-size="11" text-anchor="middle">'
                              f'{escape(xlabel)}</text>')

    def y(self, v: float) -> float:
        return T + (H - T - B) * (1 - (v - self.lo) / ((self.hi - self.lo) or 1))

    def xlabel_at(self, x: float, label: str) -> None:
        self.parts.append(f'<text x="{x:.1f}" y="{H - B + 14}" font-size="10" text-anchor="end" '
                          f'transform="rotate(-35 {x:.1f} {H - B + 14})">{escape(label)}</text>')

    def legend(self, names: list[str]) -> None:
        for k, name in enumerate(names):
            lx, ly = self.right + 14, T + 8 + k * 16
            self.parts.append(f'<rect x="{lx}" y="{ly - 9}" width="12" height="12" fill="{PALETTE[k % len(PALETTE)]}"/>'
                              f'<text x="{lx + 17}" y="{ly + 1}" font-size="11">{escape(name[:24])}</text>')

    def svg(self) -> str:
        return "".join(self.parts) + "</svg>"


def _finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def _title_width(title: str) -> int:
    return int(len(title) * 8.0) + 30


def bar_chart(title: str, ylabel: str, bars: list[tuple], *, xlabel: str = "", colors: list[int] | None = None,
              legend: list[str] | None = None, ref: float | None = None, symmetric: float | None = None) -> str:
    """bars: (label, value, low, high); low/high draw an interval (None: none). colors: a palette index per bar
    (legend names those indices); ref: a dashed horizontal reference line; symmetric: a y range centred on 0
    of at least this half-width (for changes). Each bar is labelled with its value."""
    vals = _finite([b[1] for b in bars] + [b[2] for b in bars] + [b[3] for b in bars] + [ref]) or [0.0, 1.0]
    width = max(420, L + 56 * len(bars) + 30 + (LEGEND_W if legend else 0), _title_width(title))
    right = width - (LEGEND_W if legend else 20)
    if symmetric is not None:
        half = max([symmetric] + [abs(v) * 1.15 for v in vals])
        f = _Frame(title, ylabel, -half, half, width, right, xlabel)
    else:
        f = _Frame(title, ylabel, min(0.0, min(vals)), max(vals) * 1.08 if max(vals) > 0 else max(vals), width,
                   right, xlabel)
    slot = (right - L) / max(1, len(bars))
    for i, (label, v, lo, hi) in enumerate(bars):
        x, w = L + i * slot + slot * 0.18, slot * 0.64
        color = PALETTE[(colors[i] if colors else i) % len(PALETTE)]
        if _finite([v]):
            top, base = f.y(max(v, 0)), f.y(min(v, 0))
            f.parts.append(f'<rect x="{x:.1f}" y="{top:.1f}" width="{w:.1f}" height="{max(base - top, 1):.1f}" '
                           f'fill="{color}"><title>{escape(label)}: {v:.4g}</title></rect>')
            ty = (top - 4) if v >= 0 else (base + 12)
            f.parts.append(f'<text x="{x + w / 2:.1f}" y="{ty:.1f}" font-size="10" text-anchor="middle" '
                           f'fill="#333">{v:{"+" if symmetric is not None else ""}.3g}</text>')
        else:
            f.parts.append(f'<text x="{x + w / 2:.1f}" y="{f.y(0) - 4:.1f}" font-size="11" text-anchor="middle" '
                           f'fill="#c00">{escape(str(v)) if v is not None else "n/a"}</text>')
        if _finite([lo, hi]) and len(_finite([lo, hi])) == 2:
            cx = x + w / 2
            f.parts.append(f'<path d="M{cx:.1f} {f.y(lo):.1f}V{f.y(hi):.1f}M{cx - 6:.1f} {f.y(lo):.1f}h12'
                           f'M{cx - 6:.1f} {f.y(hi):.1f}h12" stroke="#222" stroke-width="1.5" fill="none">'
                           f'<title>{escape(label)}: [{lo:.4g}, {hi:.4g}]</title></path>')
        f.xlabel_at(x + w / 2 + 4, label)
    if ref is not None and _finite([ref]):
        f.parts.append(f'<line x1="{L}" x2="{right}" y1="{f.y(ref):.1f}" y2="{f.y(ref):.1f}" stroke="#555" '
                       f'stroke-dasharray="4 3"/>')
    if legend:
        f.legend(legend)
    return f.svg()


def line_chart(title: str, ylabel: str, xlabels: list[str], series: dict[str, list[float | None]], *,
               xlabel: str = "") -> str:
    """One line per series over shared x labels (e.g. cycle and stage), with a legend on the right."""
    vals = _finite([v for s in series.values() for v in s]) or [0.0, 1.0]
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.1 or max(abs(hi) * 0.1, 1.0)
    width = max(560, L + 44 * len(xlabels) + LEGEND_W, _title_width(title) + LEGEND_W)
    right = width - LEGEND_W
    f = _Frame(title, ylabel, max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad, width, right, xlabel)
    n = max(1, len(xlabels) - 1)
    x = lambda i: L + 16 + (right - L - 32) * i / n  # noqa: E731
    for i, label in enumerate(xlabels):
        f.xlabel_at(x(i) + 4, label)
    spread = min(5.0, (right - L - 32) / n / (len(series) + 1))  # px between series at one x
    for k, (name, values) in enumerate(series.items()):
        color = PALETTE[k % len(PALETTE)]
        dx = (k - (len(series) - 1) / 2) * spread  # equal values side by side, never one line over another
        pts = [(x(i) + dx, f.y(v), v) for i, v in enumerate(values) if _finite([v])]
        if pts:  # later series dashed, each with its own marker shape
            d = "M" + "L".join(f"{px:.1f} {py:.1f}" for px, py, _ in pts)
            dash = "" if k == 0 else f' stroke-dasharray="{DASHES[(k - 1) % len(DASHES)]}"'
            f.parts.append(f'<path d="{d}" stroke="{color}" stroke-width="2" fill="none"{dash} '
                           f'data-series="{escape(name)}"/>')
            f.parts += [_marker(k, px, py, color, f"{escape(name)}: {v:.4g}") for px, py, v in pts]
    f.legend(list(series))
    return f.svg()


def _marker(k: int, x: float, y: float, color: str, title: str) -> str:
    """Series k's marker: circle, square, triangle, diamond, then again smaller."""
    r = 5.0 if k < len(SHAPES) else 3.5
    shape = SHAPES[k % len(SHAPES)]
    pts = " ".join(f"{x + dx * r:.1f},{y + dy * r:.1f}" for dx, dy in shape) if shape else ""
    tag, where = ("polygon", f'points="{pts}"') if shape else ("circle", f'cx="{x:.1f}" cy="{y:.1f}" r="{r}"')
    return f'<{tag} {where} fill="{color}" stroke="#fff" stroke-width="0.8"><title>{title}</title></{tag}>'


SHAPES = ((), ((-1, -1), (1, -1), (1, 1), (-1, 1)), ((0, -1.2), (1.1, 0.9), (-1.1, 0.9)),
          ((0, -1.3), (1.3, 0), (0, 1.3), (-1.3, 0)))
