"""The docs name only files that exist: every path in the README and the docs it leads to, written as `path`, is a
file or folder of the repository (a bare name, `engine.py`, must be some file's name; `checks/memleak.py` some file's
path ending), and every relative link, [text](path) or [text](path#anchor), is a file beside the doc and, into a
markdown file, one of its headings."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHLIKE = re.compile(r"`([\w./-]+(?:\.(?:py|md|toml|sh|json|jsonl|yaml|txt|html|xml)|/))`")
MADE_BY_A_RUN = {"results.jsonl", "run.json", "report.md", "report.html", "junit.xml", "summary.md", "artifacts/",
                 "logs/"}  # inside a run directory


def repository_paths() -> set[str]:
    out = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
                   and not d.endswith(".egg-info")]
        rel = Path(top).relative_to(ROOT).as_posix()
        for name in files + [d + "/" for d in dirs]:
            out.add(name if rel == "." else f"{rel}/{name}")
    return out


LINK = re.compile(r"\]\(([\w./-]+)\)")
DOCS = ["README.md", "BENCHMARKS.md", "docs/DESIGN.md", "docs/commands.md", "docs/ci.md", "docs/development.md",
        "docs/vllm-gpu-results.md"]


FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
ANY_LINK = re.compile(r"\]\(([^)\s]+)\)")


def headings(text: str) -> list[str]:
    """A markdown file's headings, outside fenced code."""
    return [x.lstrip("#").strip() for x in FENCE.sub("", text).splitlines() if re.match(r"#{1,6} ", x)]


def anchors(text: str) -> set[str]:
    """GitHub's anchors of the headings: lowercase, punctuation but '-' and '_' dropped, spaces to '-', a repeated
    one suffixed -1, -2, ..."""
    out, seen = set(), {}
    for h in headings(text):
        slug = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


LINKED = ["README.md", "BENCHMARKS.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", LINKED)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(doc):
    text = CODE.sub("", FENCE.sub("", (ROOT / doc).read_text(encoding="utf-8")))
    wrong = []
    for link in ANY_LINK.findall(text):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        path, _, anchor = link.partition("#")
        target = (ROOT / doc).parent.joinpath(path) if path else ROOT / doc
        if not target.exists():
            wrong.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text(encoding="utf-8")):
            wrong.append(f"{link}: no such heading in {path or doc}")
    assert not wrong, wrong


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_the_doc_names_exists(doc):
    paths = repository_paths()
    text = (ROOT / doc).read_text(encoding="utf-8")
    links = LINK.findall(text)  # each checked by the test above
    named = {x for x in PATHLIKE.findall(text) if not x.startswith("RUN_DIR/")} - MADE_BY_A_RUN  # a run's own
    assert len(named) + len(links) >= 5, named  # the patterns still find the doc's paths
    missing = [p for p in sorted(named) if not any(x == p.lstrip("./") or x.endswith("/" + p.lstrip("./"))
                                                   for x in paths)]
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_the_shipped_configs_memleak_threshold_comment_states_the_retention_limit():
    """kvdiag.toml's comment on ``threshold_mib`` says what the option is: the retention limit and its default."""
    from kvdiag.checks.memleak.verdict import RETAIN_FRACTION, RETAIN_MIN, MiB

    line = next(x for x in (ROOT / "kvdiag.toml").read_text().splitlines() if x.startswith("# threshold_mib"))
    assert "retention limit" in line and "growth" not in line, line
    assert f"max({RETAIN_MIN // MiB} MiB, {RETAIN_FRACTION:.0%} of peak)" in line, line


def test_the_baseline_the_readme_and_config_name_is_committed_outside_the_run_output_folder():
    """The baseline of the CI example loads as a baseline and lives where runs never write (``reports/`` is the
    git-ignored output folder), with the advice on where to commit baselines pointing there too."""
    from kvdiag.report.baseline import load_side

    readme, toml = (ROOT / "README.md").read_text(encoding="utf-8"), (ROOT / "kvdiag.toml").read_text()
    named = set(re.findall(r"--baseline ([\w./-]+\.json)", readme) + re.findall(r'baseline = "([\w./-]+\.json)"',
                                                                                toml))
    assert named == {"baselines/ci-tiny-llama.json"}, named
    assert "reports/baselines" not in readme + toml
    side = load_side(ROOT / "baselines/ci-tiny-llama.json")
    from kvdiag.checks.registry import checks

    assert len(side.cases) >= 5 and all(c.split("/")[0] in checks() for c in side.cases)
