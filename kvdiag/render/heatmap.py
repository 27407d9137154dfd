"""A heatmap as self-contained SVG (no plotting library, no scripts): panels of one grid side by side (a dtype's and
the baseline's), a shared colour scale from 0 to 1, each cell's value written in it, axis labels, and an outlined
cell (the worst)."""

from __future__ import annotations

import math
from html import escape

# 0 red, 0.5 yellow, 1 green: the colours of the needle-in-a-haystack pictures
STOPS = ((0.0, (215, 48, 39)), (0.5, (254, 224, 139)), (1.0, (26, 152, 80)))
CW, CH = 58, 30  # a cell
LEFT, TOP, GAP, SCALE_W = 78, 62, 34, 74  # margins, between panels, the colour scale
TITLE_Y, SUB_Y = 18, 44


def color(v: float) -> str:
    """The fill of value ``v`` (clamped to [0, 1])."""
    v = min(1.0, max(0.0, v))
    for (a, ca), (b, cb) in zip(STOPS, STOPS[1:]):
        if v <= b:
            t = (v - a) / (b - a)
            return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb))
    return "#" + "".join(f"{x:02x}" for x in STOPS[-1][1])


def _ink(fill: str) -> str:
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#111"


def heatmap(title: str, xlabels: list[str], ylabels: list[str], panels: list[dict], *, xlabel: str = "",
            ylabel: str = "") -> str:
    """``panels``: each ``{"name", "values": [[row][col]], "n": [[...]] (optional), "mark": (row, col) or None}``,
    rows along ``ylabels``, columns along ``xlabels``; a value None is an empty cell. Values in [0, 1]."""
    rows, cols = len(ylabels), len(xlabels)
    pw = cols * CW
    width = max(LEFT + len(panels) * (pw + GAP) + SCALE_W, int(len(title) * 7.6) + 40)
    height = TOP + rows * CH + 56
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" role="img" class="plot heatmap" font-family="system-ui, sans-serif">'
           f'<title>{escape(title)}</title><rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{width / 2}" y="{TITLE_Y}" text-anchor="middle" font-size="13" font-weight="bold">'
           f'{escape(title)}</text>']
    mid = TOP + rows * CH / 2
    out.append(f'<text x="14" y="{mid}" font-size="11" text-anchor="middle" transform="rotate(-90 14 {mid})">'
               f'{escape(ylabel)}</text>')
    for i, label in enumerate(ylabels):
        out.append(f'<text x="{LEFT - 6}" y="{TOP + i * CH + CH / 2 + 4}" font-size="10" text-anchor="end">'
                   f'{escape(label)}</text>')
    for k, panel in enumerate(panels):
        out += _panel(panel, LEFT + k * (pw + GAP), xlabels, ylabels, xlabel)
    out += _scale(width - SCALE_W + 22, TOP, rows * CH)
    return "".join(out) + "</svg>"


def _panel(panel: dict, x0: float, xlabels: list[str], ylabels: list[str], xlabel: str) -> list[str]:
    pw, rows = len(xlabels) * CW, len(ylabels)
    name = escape(panel["name"])
    out = [f'<g class="panel" data-name="{name}"><text x="{x0 + pw / 2}" y="{SUB_Y}" font-size="12" '
           f'text-anchor="middle">{name}</text>']
    for i in range(rows):
        for j, xl in enumerate(xlabels):
            v = panel["values"][i][j]
            n = (panel.get("n") or [[None] * len(xlabels)] * rows)[i][j]
            x, y = x0 + j * CW, TOP + i * CH
            ok = isinstance(v, (int, float)) and math.isfinite(v)
            fill = color(v) if ok else "#eeeeee"
            tip = f"{panel['name']}: {xl} x {ylabels[i]}: " + (f"{v:.3f}" if ok else "no documents") + \
                (f" ({n} documents)" if n is not None else "")
            out.append(f'<rect class="cell" x="{x}" y="{y}" width="{CW}" height="{CH}" fill="{fill}" '
                       f'stroke="#fff" data-row="{i}" data-col="{j}" data-value="{v if ok else ""}">'
                       f'<title>{escape(tip)}</title></rect>')
            out.append(f'<text x="{x + CW / 2}" y="{y + CH / 2 + 4}" font-size="11" text-anchor="middle" '
                       f'fill="{_ink(fill)}">{f"{v:.2f}" if ok else "–"}</text>')
    if panel.get("mark") is not None:
        i, j = panel["mark"]
        out.append(f'<rect class="mark" x="{x0 + j * CW + 1.5}" y="{TOP + i * CH + 1.5}" width="{CW - 3}" '
                   f'height="{CH - 3}" fill="none" stroke="#000" stroke-width="3"/>')
    bottom = TOP + rows * CH
    for j, label in enumerate(xlabels):
        out.append(f'<text x="{x0 + j * CW + CW / 2}" y="{bottom + 14}" font-size="10" text-anchor="middle">'
                   f'{escape(label)}</text>')
    if xlabel:
        out.append(f'<text x="{x0 + pw / 2}" y="{bottom + 34}" font-size="11" text-anchor="middle">'
                   f'{escape(xlabel)}</text>')
    return out + ["</g>"]


def _scale(x: float, top: float, h: float) -> list[str]:
    """The colour scale: 0 at the bottom, 1 at the top."""
    steps = 20
    out = ['<g class="scale">']
    for s in range(steps):
        v = (s + 0.5) / steps
        out.append(f'<rect x="{x}" y="{top + h * (1 - (s + 1) / steps):.1f}" width="14" '
                   f'height="{h / steps + 0.5:.1f}" fill="{color(v)}"/>')
    for v in (0.0, 0.5, 1.0):
        out.append(f'<text x="{x + 18}" y="{top + h * (1 - v) + 4:.1f}" font-size="10">{v:g}</text>')
    return out + ["</g>"]
