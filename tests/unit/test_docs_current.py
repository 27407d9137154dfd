"""Docs that are current: the GPU results are current tables only, history sits in one frozen archive, the code's
comments carry no machine figures or dates (those go to the docs, beside their commands), nothing in the repository
points outside it, and a doc's section named in a citation exists."""

from __future__ import annotations

import ast
import hashlib
import io
import os
import re
import tokenize
from pathlib import Path

import pytest
from test_docs import headings

ROOT = Path(__file__).resolve().parents[2]
ARCHIVE = ROOT / "docs" / "archive.md"
ARCHIVE_SHA256 = "25568679ff7f33a173d72d2a71f27983d333f12816d0f92be9637ae5a3a8474b"
RESULTS = ROOT / "docs" / "vllm-gpu-results.md"
DATE = re.compile(r"20\d\d-\d\d-\d\d")
GPU = re.compile(r"\b(?:H100|H200|A100|B200)\b")


def test_the_archive_is_frozen():
    digest = hashlib.sha256(ARCHIVE.read_text(encoding="utf-8").replace("\r\n", "\n").encode()).hexdigest()
    assert digest == ARCHIVE_SHA256, (
        "docs/archive.md changed: its history is frozen. A new measurement goes to a current table "
        "(docs/vllm-gpu-results.md, BENCHMARKS.md) beside the command that produced it, replacing the row it updates.")


def test_the_gpu_results_are_current_tables_only():
    lines = RESULTS.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 160, f"{len(lines)} lines: current tables only, a session's story is docs/archive.md's"
    dated = [x for x in lines if x.startswith("#") and DATE.search(x)]
    assert not dated, f"dated sections in docs/vllm-gpu-results.md (history is the archive's): {dated}"


OUTPUTS = {"build", "dist", "reports"}  # what builds and runs write into a checkout (git-ignored): not its text


def text_files():
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__" and not d.endswith(".egg-info")
                   and not (Path(top) == ROOT and d in OUTPUTS)]
        for name in files:
            path = Path(top) / name
            if path.stat().st_size > 1 << 20:
                continue
            data = path.read_bytes()
            if b"\0" not in data:
                yield path, data.decode("utf-8", "replace")


def test_nothing_in_the_repository_points_outside_it():
    outside = ".." + "/shared"  # split so that this file does not name it
    found = [str(p.relative_to(ROOT)) for p, text in text_files() if outside in text]
    assert not found, f"these point outside the repository ({outside}): {found}"


def comments_and_docstrings(path: Path):
    src = path.read_text(encoding="utf-8")
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        if t.type == tokenize.COMMENT:
            yield t.start[0], t.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


@pytest.mark.parametrize("top", ["kvdiag", "kernels"])
def test_no_comment_in_the_code_names_a_gpu_model_or_a_date(top):
    found = [f"{p.relative_to(ROOT)}:{line}: {text.strip()[:100]}" for p in sorted((ROOT / top).rglob("*.py"))
             for line, text in comments_and_docstrings(p) if GPU.search(text) or DATE.search(text)]
    assert not found, ("a machine's figures and dates go to the docs, beside their commands "
                       "(docs/vllm-gpu-results.md, BENCHMARKS.md); the comment keeps the why:\n" + "\n".join(found))


CITED = re.compile(r"((?:docs/)?[\w-]+\.md),?\s+(?:#\s*)?\(?\"([^\"]{1,80})\"")
WRAPPED = re.compile(r"\s*\n\s*(?:#\s*)?")  # a citation folded over two lines of prose or of a comment


EXAMPLES = ROOT / "tests" / "integration" / "test_docs_examples.py"  # names each doc example by its text, not a section


def test_every_section_a_citation_names_exists():
    """`docs/DESIGN.md, "Layers"` in the code, the config or the docs names a heading of that file (its start)."""
    wrong = []
    for path, text in text_files():
        if path in (ARCHIVE, EXAMPLES) or path.suffix not in (".py", ".md", ".toml"):
            continue
        for doc, section in CITED.findall(text):
            section = WRAPPED.sub(" ", section)
            target = next((x for x in (ROOT / doc, ROOT / "docs" / doc, path.parent / doc) if x.is_file()), None)
            if target is None:
                continue  # a file name the docs test holds to the repository
            names = [h.replace("`", "").lower() for h in headings(target.read_text(encoding="utf-8"))]
            if not any(h.startswith(section.replace("`", "").lower()) for h in names):
                wrong.append(f"{path.relative_to(ROOT)}: {doc}, \"{section}\"")
    assert not wrong, wrong
