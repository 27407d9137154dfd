"""Baselines: one JSON file that holds what a later run is compared with (`kvdiag ci --baseline`).

A baseline keeps every case record (without log tails) and, for accuracy cases, the
per-document samples, so a later comparison can use the paired per-document test.
A "side" of a comparison is either a baseline file or a run directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvdiag.errors import UserError

FORMAT = "kvdiag-baseline/1"


@dataclass
class Side:
    label: str  # what the user passed: a path
    cases: dict  # id -> CaseResult
    samples: dict = field(default_factory=dict)  # accuracy case id -> {task: {metric: {doc: value}}}
    command: str = "?"
    started: str = "?"


def _samples_of(run_dir: Path, rec) -> dict | None:
    name = (rec.metrics.get("artifacts") or {}).get("samples")
    if not name:
        return None
    try:
        return json.loads((Path(run_dir) / "artifacts" / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def side_of_run(run, label: str | None = None, run_dir=None) -> Side:
    """A run as one side of a comparison; samples come from ``run_dir`` (default: where the run says it is)."""
    run_dir = run_dir or run.run_dir
    samples = {}
    for c in run.cases:
        s = _samples_of(Path(run_dir), c) if run_dir else None
        if s is not None:
            samples[c.id] = s
    return Side(label or str(run_dir), {c.id: c for c in run.cases}, samples, run.command, run.started)


def load_side(path) -> Side:
    """A run directory (or its run.json / results.jsonl) or a baseline file; bad input: UserError."""
    from kvdiag.results import CaseResult, load_run

    path = Path(path)
    if path.is_file() and path.name in ("run.json", "results.jsonl"):
        path = path.parent
    if path.is_dir():
        return side_of_run(load_run(path), str(path), path)  # a copied run dir: its own artifacts
    if not path.exists():
        raise UserError(f"baseline not found: {path} (give a run directory or a baseline .json file)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a kvdiag baseline (no \"format\": \"{FORMAT}\")")
        cases = [CaseResult.from_json(c) for c in data["cases"]]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path}: unreadable baseline ({type(e).__name__}: {e})") from None
    return Side(str(path), {c.id: c for c in cases}, data.get("samples") or {}, data.get("command", "?"),
                data.get("started", "?"))


def baseline_json(run) -> dict:
    side = side_of_run(run)
    cases = []
    for c in run.cases:
        d = c.to_json()
        d.pop("log_tail", None)
        cases.append(d)
    return {"format": FORMAT, "command": run.command, "started": run.started,
            "environment": run.environment, "cases": cases, "samples": side.samples}


def write_baseline(run, path) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(baseline_json(run), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write baseline '{path}': {e.strerror or e}") from None
    return path
