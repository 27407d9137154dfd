"""The needle heatmap of report.html (kvdiag/render/heatmap.py, checks/accuracy/needle_view.py): valid SVG with one
cell per (length, depth) in each panel, each cell's value, colour and text its grid's, the baseline's panel beside
each dtype's, and the worst cell outlined."""

import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from kvdiag.checks.accuracy.needle import worst
from kvdiag.checks.accuracy.needle_view import heatmaps
from kvdiag.render.heatmap import color, heatmap

NS = {"s": "http://www.w3.org/2000/svg"}


def _panels(svg: str) -> dict:
    """{panel name: {(row, col): (value or None, fill, text)}}."""
    root = ET.fromstring(svg)
    out = {}
    for g in root.iterfind(".//s:g[@class='panel']", NS):
        cells, texts = g.findall("s:rect[@class='cell']", NS), [t for t in g.findall("s:text", NS)][1:]
        got = {}
        for k, r in enumerate(cells):
            v = r.get("data-value")
            got[(int(r.get("data-row")), int(r.get("data-col")))] = (float(v) if v else None, r.get("fill"),
                                                                     texts[k].text)
        out[g.get("data-name")] = got
    return out


def test_one_cell_per_length_and_depth_with_its_value():
    values = [[0.0, 0.25, 1.0], [0.5, None, 0.875]]
    svg = heatmap("t", ["128", "256", "512"], ["0%", "100%"], [{"name": "fp8", "values": values, "mark": (1, 2)}],
                  xlabel="context length", ylabel="depth")
    cells = _panels(svg)["fp8"]
    assert sorted(cells) == [(i, j) for i in range(2) for j in range(3)]
    for (i, j), (v, fill, text) in cells.items():
        want = values[i][j]
        if want is None:
            assert v is None and text == "–" and fill == "#eeeeee"
        else:
            assert v == want and text == f"{want:.2f}" and fill == color(want)
    assert _outlined(ET.fromstring(svg).find(".//s:g[@class='panel']", NS)) == (1, 2)


def test_the_colour_scale_runs_from_red_to_green():
    rgb = lambda c: tuple(int(c[i:i + 2], 16) for i in (1, 3, 5))  # noqa: E731
    assert color(0.0) == "#d73027" and color(1.0) == "#1a9850" and color(-1) == color(0) and color(2) == color(1)
    greens = [rgb(color(v / 10))[1] for v in range(11)]
    reds = [rgb(color(v / 10))[0] for v in range(6, 11)]
    assert greens[:6] == sorted(greens[:6]) and reds == sorted(reds, reverse=True)  # red -> yellow -> green


def _outlined(panel) -> tuple[int, int]:
    """(row, col) of the cell under a panel's outline."""
    m = panel.find("s:rect[@class='mark']", NS)
    x, y = float(m.get("x")), float(m.get("y"))
    cell = next(r for r in panel.findall("s:rect[@class='cell']", NS)
                if float(r.get("x")) < x < float(r.get("x")) + float(r.get("width"))
                and float(r.get("y")) < y < float(r.get("y")) + float(r.get("height")))
    return int(cell.get("data-row")), int(cell.get("data-col"))


def _case(dtype, role, grid):
    return SimpleNamespace(kv_dtype=dtype, params={"role": role}, metrics={"needle": {"kv_needle": grid}})


def test_each_dtype_is_drawn_beside_the_baseline_with_its_worst_cell_outlined():
    lengths, depths = [128, 256, 512], [0.0, 0.5, 1.0]
    base = {"metric": "acc", "lengths": lengths, "depths": depths,
            "score": [[1.0, 1.0, 0.5], [1.0, 0.75, 1.0], [1.0, 1.0, 1.0]], "n": [[4] * 3] * 3}
    fp8 = {**base, "score": [[1.0, 0.75, 0.5], [1.0, 0.75, 1.0], [0.25, 1.0, 1.0]]}
    base["worst"], fp8["worst"] = worst(base, None), worst(fp8, base)
    figures = heatmaps([_case("auto", "baseline", base), _case("fp8", "test", fp8)])
    assert len(figures) == 1  # the baseline is drawn beside fp8, not alone as well
    panels = _panels(figures[0])
    assert list(panels) == ["auto (baseline)", "fp8"]
    for name, grid in (("auto (baseline)", base), ("fp8", fp8)):
        assert len(panels[name]) == len(lengths) * len(depths)
        for (i, j), (v, _, _) in panels[name].items():
            assert v == grid["score"][i][j]
    root = ET.fromstring(figures[0])
    mark = [g for g in root.iterfind(".//s:g[@class='panel']", NS) if g.find("s:rect[@class='mark']", NS) is not None]
    assert [g.get("data-name") for g in mark] == ["fp8"]
    row, col = _outlined(mark[0])
    assert (lengths[col], depths[row]) == (128, 1.0)  # it dropped 0.75 there
    title = root.find("s:title", NS).text
    assert "kv_needle acc" in title and "fp8" in title and "auto" in title


@pytest.mark.parametrize("others", [0, 1])
def test_the_baseline_alone_gets_its_own_heatmap(others):
    g = {"metric": "acc", "lengths": [64], "depths": [0.0, 1.0], "score": [[1.0], [0.5]], "n": [[2], [2]]}
    g["worst"] = worst(g, None)
    cases = [_case("auto", "baseline", g)] + [SimpleNamespace(kv_dtype="fp8", params={"role": "test"}, metrics={})
                                              for _ in range(others)]
    (svg,) = heatmaps(cases)
    assert list(_panels(svg)) == ["auto (baseline)"]
