"""The docs' examples as data, for the tests that run them (tests/integration/test_docs_examples.py keeps the
inventory): the code blocks of README.md and docs/*.md (docs/archive.md, the frozen history, left out), the lines in
them that run kvdiag, and the figures of a sample output (a table row of kvdiag's terminal output, the line that
ends a run), each read from the doc itself so that a test holds the run to what the doc says."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "archive.md")]

# a line that runs kvdiag or installs it: the command, `python -m kvdiag...`, the library, kvdiag's own scripts, pip
RUNS = re.compile(r"(?:^|[\s;&|(`\"])(?:kvdiag\s+(?:-|[a-z])|python3?\s+-m\s+kvdiag\b|kvdiag\.run_check\("
                  r"|(?:from|import)\s+kvdiag\b|(?:bash|python3?)\s+scripts/|pip3?\s+(?:install|wheel)\b)")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # its first line's number in the doc (1-based)
    kind: str  # the fence's language (bash, python, yaml), "plain" (a fence without one) or "indented"
    lines: tuple[str, ...]

    def joined(self) -> list[tuple[int, str]]:
        """(line number, text) of each shell line, a line continued with ``\\`` joined to the next."""
        out, i = [], 0
        while i < len(self.lines):
            start, text = i, self.lines[i].strip()
            while text.endswith("\\") and i + 1 < len(self.lines):
                i += 1
                text = text[:-1].rstrip() + " " + self.lines[i].strip()
            out.append((self.line + start, text))
            i += 1
        return out

    def commands(self) -> list[tuple[int, str]]:
        """(line number, command) of each line that runs kvdiag (continued lines joined), a trailing ``  # comment``
        left out, leading ``- run:`` of a yaml step kept."""
        return [(n, command_text(text)) for n, text in self.joined() if RUNS.search(text)]


def command_text(line: str) -> str:
    """A doc's line without its trailing comment (two spaces or more, then ``#``), whitespace runs as one space."""
    return " ".join(re.split(r"\s{2,}#", line.strip(), maxsplit=1)[0].split())


def comment(line: str) -> str:
    """The trailing comment of a doc's line ('' if none)."""
    parts = re.split(r"\s{2,}#", line, maxsplit=1)
    return parts[1].strip() if len(parts) == 2 else ""


def blocks(doc: str) -> list[Block]:
    """Every code block of ``doc``: fenced (```lang ... ```) and indented (4 spaces or more after a blank line, as
    markdown reads them, in a list item too)."""
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    out, i, after_blank = [], 0, True
    while i < len(lines):
        text = lines[i].strip()
        if text.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            out.append(Block(doc, i + 2, text[3:].strip() or "plain", tuple(lines[i + 1:end])))
            i, after_blank = end + 1, False
            continue
        if text and after_blank and len(lines[i]) - len(lines[i].lstrip()) >= 4:
            end = i
            while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) >= 4):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            out.append(Block(doc, i + 1, "indented", tuple(lines[i:end])))
            i, after_blank = end, False
            continue
        after_blank = not text
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc)]


def find_block(doc: str, first_line_starts: str) -> Block:
    (b,) = [b for b in blocks(doc) if b.lines and b.lines[0].strip().startswith(first_line_starts)]
    return b


def find_command(doc: str, starts: str) -> tuple[str, str]:
    """(command, its comment) of the line of ``doc``'s code whose command is ``starts``, else of the one line that
    starts with it."""
    lines = [x for b in blocks(doc) for _, x in b.joined()]  # a command continued with a backslash read whole
    exact = [x for x in lines if command_text(x) == command_text(starts)]
    (line,) = exact or [x for x in lines if x.startswith(starts)]
    return command_text(line), comment(line)


def seconds(text: str) -> float:
    """The first time a doc's text states: ``36 s``, ``9.7 s``, ``2 min 22 s``."""
    m = re.search(r"(?:(\d+) min )?(\d+(?:\.\d+)?) s\b", text)
    assert m, text
    return 60 * int(m.group(1) or 0) + float(m.group(2))


def idle_seconds(run: dict, wall: float, cores: int = 2) -> float:
    """A run's time as a doc measures it, on ``cores`` CPU cores that nothing else uses: its workers' CPU seconds
    (run.json) spread over the cores, or its wall time where that is less. A test holds it to at most 3x the doc's
    figure: the CPU seconds do not grow when the tests share the cores with each other, the wall time does."""
    cpu = sum(a["timings"]["cpu"] for a in run["analysis"].values() if isinstance(a, dict) and "timings" in a
              and "cpu" in a["timings"])
    return min(wall, cpu / cores) if cpu else wall


def table_rows(lines, cells: int) -> list[list[str]]:
    """The rows (``│ a │ b │``) of a terminal table of kvdiag's with ``cells`` cells, each cell stripped."""
    rows = []
    for line in lines:
        parts = [c.strip() for c in line.strip().split("│")]
        if len(parts) == cells + 2 and parts[0] == parts[-1] == "":
            rows.append(parts[1:-1])
    return rows


@dataclass(frozen=True)
class ScoreRow:
    """A row of the accuracy table as a doc shows it: ``│ fp8 │ kv_recall acc │ 0.995±0.005 │ -0.005 │ [-0.01, +0.00]
    │ 1 │ ≥0.0388 │ inconclusive n≈391 │``."""
    kv_dtype: str
    task: str
    metric: str
    score: float
    stderr: float
    delta: float
    p_value: float
    mdd: float
    verdict: str
    n_needed: int | None


def score_rows(lines) -> list[ScoreRow]:
    out = []
    for dtype, task_metric, score, delta, _ci, p, sees, verdict in table_rows(lines, 8):
        if dtype == "kv dtype":
            continue
        task, metric = task_metric.split()
        value, _, se = score.partition("±")
        words = verdict.split()
        out.append(ScoreRow(dtype, task, metric, float(value), float(se), float(delta), float(p),
                            float(sees.lstrip("≥")), words[0], int(words[1].lstrip("n≈")) if len(words) > 1 else None))
    return out


@dataclass(frozen=True)
class DriftRow:
    kv_dtype: str
    mean_kl: float
    max_kl: float
    top1: float


def drift_rows(lines) -> list[DriftRow]:
    out = []
    for dtype, kl, top1, _spark in table_rows(lines, 4):
        if dtype == "kv dtype":
            continue
        mean, _, most = kl.partition(" / ")
        out.append(DriftRow(dtype, float(mean), float(most), float(top1)))
    return out


def readme_main_job() -> dict:
    """What the README says of `kvdiag accuracy` (the main job): its sample output's rows, the line that ends it,
    and the time the sentence before it states."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    intro = next(x for x in text.splitlines() if x.startswith("`kvdiag accuracy` on the shipped tiny model"))
    sample = find_block("README.md", "accuracy vs baseline")
    return {"seconds": seconds(intro), "header": sample.lines[0].strip(), "scores": score_rows(sample.lines),
            "drift": drift_rows(sample.lines), "last": sample.lines[-1].strip()}


BASELINE = "baselines/ci-tiny-llama.json"


def run_readme_ci(root: Path) -> dict:
    """The README's CI command as written (`kvdiag ci --config kvdiag.toml --output-dir reports/ci --baseline
    baselines/ci-tiny-llama.json`; docs/ci.md's GitHub Actions step runs the same), in ``root``, a folder holding the
    repository's kvdiag.toml and committed baseline (so that reports/ci is the test's), with ``$GITHUB_STEP_SUMMARY``
    set as in a GitHub Actions step. {"root", "A": the run directory, "a": the finished command, "summary": the job
    summary file (an earlier step's line, then what kvdiag appended)}."""
    import os

    command, _ = find_command("README.md", "kvdiag ci --config kvdiag.toml --output-dir")
    assert find_command("docs/ci.md", "run: kvdiag ci --config")[0] == "run: " + command  # the same in the job
    for name in ("kvdiag.toml", BASELINE):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    summary = root / "summary.md"
    summary.write_text("## earlier step\n")
    argv = shlex.split(command)
    assert argv[0] == "kvdiag"
    a = subprocess.run([sys.executable, "-m", "kvdiag", *argv[1:]], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}, timeout=900)
    return {"root": root, "A": root / "reports" / "ci", "a": a, "summary": summary}
