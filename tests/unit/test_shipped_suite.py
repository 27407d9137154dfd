"""The repository's own CI suite and its committed baseline: `kvdiag ci --config kvdiag.toml --baseline
baselines/ci-tiny-llama.json` (README, docs/ci.md) holds every case of the suite to the baseline, so a check added
to the suite without its baseline fails here."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_baseline_holds_every_case_of_the_shipped_suite():
    from kvdiag.ci.config import load_config
    from kvdiag.ci.suite import build_suite

    cases, _ = build_suite(load_config(ROOT / "kvdiag.toml"))
    base = json.loads((ROOT / "baselines" / "ci-tiny-llama.json").read_text())
    suite, held = [c.id for c in cases], {c["id"] for c in base["cases"]}
    assert set(suite) <= held, f"not in the baseline: {sorted(set(suite) - held)} (refresh it: --update-baseline)"
    assert held <= set(suite), f"in the baseline, no longer in the suite: {sorted(held - set(suite))}"
    assert {c.check for c in cases} == {c["check"] for c in base["cases"]} >= {"paths", "memleak", "accuracy"}
