"""`kvdiag accuracy -t kv_needle` end to end on the builtin engine: the terminal table names each dtype's worst cell,
run.json keeps every dtype's grid, and report.html draws each dtype's grid as a heatmap beside the baseline's, all
equal to a recount of the run's own per-document results; a needle length past the model's window exits 2 before
any worker starts."""

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvdiag.tasks import needle

ROOT = Path(__file__).resolve().parents[2]
LENGTHS, LIMIT, DTYPES = [256, 2048], 30, ["auto", "fp8_e5m2"]  # 3 documents a cell; at 2048 tiny-llama misses some
NS = {"s": "http://www.w3.org/2000/svg"}

pytestmark = pytest.mark.slow


def kvdiag(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "150"}, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("needle") / "run"
    lengths = [a for n in LENGTHS for a in ("--needle-length", n)]
    r = kvdiag("accuracy", "-t", "kv_needle", *lengths, "--limit", LIMIT, *[a for d in DTYPES for a in ("-d", d)],
               "-o", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, out


def recount(out: Path) -> dict:
    """{dtype: {(length, depth): (mean, n)}} from the samples artifact of each dtype and the task's documents."""
    docs = needle.documents(LENGTHS)[:LIMIT]  # lm_eval's --limit takes the first documents
    rec = json.loads((out / "run.json").read_text())
    got = {}
    for case in rec["cases"]:
        samples = json.loads((out / "artifacts" / case["metrics"]["artifacts"]["samples"]).read_text())
        per: dict = {}
        for doc_id, v in samples["kv_needle"]["acc"].items():
            d = docs[int(doc_id)]
            per.setdefault((d["needle_length"], d["needle_depth"]), []).append(v)
        assert sum(map(len, per.values())) == LIMIT and len(per) == len(LENGTHS) * len(needle.DEPTHS)
        got[case["kv_dtype"]] = {cell: (sum(vs) / len(vs), len(vs)) for cell, vs in per.items()}
    return got


def expected_worst(cells: dict, base: dict | None) -> tuple:
    """The largest drop from the baseline's cell, then the lowest score, then the longest, then the deepest."""
    return min(cells, key=lambda c: (cells[c][0] - base[c][0] if base else 0.0, cells[c][0], -c[0], -c[1]))


def test_the_table_names_each_dtypes_worst_cell(run):
    r, out = run
    counts = recount(out)
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("needle grid"))
    for dtype in DTYPES:
        cells = counts[dtype]
        length, depth = expected_worst(cells, None if dtype == "auto" else counts["auto"])
        row = next(line for line in lines[head:] if line.startswith(f"│ {dtype} "))
        assert f"{length} tok, depth {depth:.0%}" in row, (row, cells)
        assert f"{cells[(length, depth)][0]:.2f} ({cells[(length, depth)][1]})" in row, row
        if dtype != "auto":
            assert f"{counts['auto'][(length, depth)][0]:.2f}" in row
    a = json.loads((out / "run.json").read_text())["analysis"]["accuracy"]
    for row in a["needle"]:
        assert row["lengths"] == LENGTHS and row["depths"] == list(needle.DEPTHS)
        for i, d in enumerate(row["depths"]):
            for j, n in enumerate(row["lengths"]):
                assert (row["score"][i][j], row["n"][i][j]) == pytest.approx(counts[row["kv_dtype"]][(n, d)])


def test_report_html_draws_each_dtypes_heatmap_beside_the_baseline(run):
    _, out = run
    counts = recount(out)
    html = (out / "report.html").read_text()
    svgs = [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", html, re.S)]
    maps = [s for s in svgs if "heatmap" in (s.get("class") or "")]
    assert len(maps) == 1, [s.find("s:title", NS).text for s in svgs]
    panels = {g.get("data-name"): g for g in maps[0].iterfind(".//s:g[@class='panel']", NS)}
    assert list(panels) == ["auto (baseline)", "fp8_e5m2"]
    for name, g in panels.items():
        cells = g.findall("s:rect[@class='cell']", NS)
        assert len(cells) == len(LENGTHS) * len(needle.DEPTHS)
        for c in cells:
            cell = (LENGTHS[int(c.get("data-col"))], needle.DEPTHS[int(c.get("data-row"))])
            assert float(c.get("data-value")) == pytest.approx(counts[name.split(" ")[0]][cell][0])
    md = (out / "report.md").read_text()
    assert "kv_needle acc per cell, fp8_e5m2 (Δ vs 'auto')" in md and "needle grid" in md


def test_report_html_renders_in_headless_chromium(run, tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.skip("no chromium on this machine")
    _, out = run
    shot = tmp_path / "report.png"
    r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                        "--window-size=1300,3600", (out / "report.html").resolve().as_uri()], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and shot.stat().st_size > 20_000, r.stderr[-2000:]


def test_a_needle_length_past_the_window_exits_2_before_any_worker(tmp_path):
    out = tmp_path / "run"
    r = kvdiag("accuracy", "-t", "kv_needle", "--needle-length", 4096, "-d", "auto", "-o", out, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "kvdiag: error: needle length 4096: longer than the engine's max_model_len for tiny-llama (2048 tokens)"]
    assert not out.exists()
