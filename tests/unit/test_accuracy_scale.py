"""A large task over many dtypes: the parent's analysis holds the baseline and one dtype's documents at a time, so
its memory does not grow with the number of dtypes (10,000 documents, 2 against 7 dtypes, tracemalloc)."""

import json
import tracemalloc

import numpy as np
import pytest

from kvdiag.checks.accuracy import verdict as accuracy
from kvdiag.checks.sweep import drift
from kvdiag.results import CaseResult, RunRecord

DOCS = 10_000


def synthetic_run(tmp_path, dtypes):
    rng = np.random.default_rng(0)
    art = tmp_path / "artifacts"
    art.mkdir(parents=True)
    dists = [np.log(np.full((8, 32), 1 / 32, dtype=np.float32))]
    cases = []
    for i, d in enumerate(dtypes):
        values = (rng.random(DOCS) < 0.6).astype(float)
        samples = {"big": {"acc": {str(k): v for k, v in enumerate(values)}}}
        (art / f"{d}.samples.json").write_text(json.dumps(samples))
        drift.save({"over": "full", "dists": dists, "greedy": [[1, 2]], "chosen": [[-0.5] * 8],
                    "greedy_logprobs": [[-0.1, -0.1]]}, art / f"{d}.drift.npz")
        score = {"score": float(values.mean()), "stderr": 0.005, "higher_is_better": True, "n": DOCS}
        cases.append(CaseResult(f"accuracy/builtin/m/{d}", "accuracy", "builtin", "m", d, "pass",
                                params={"role": "baseline" if i == 0 else "test"},
                                metrics={"scores": {"big": {"acc": score}}, "model_dtype": "bfloat16", "finite": True,
                                         "artifacts": {"samples": f"{d}.samples.json", "drift": f"{d}.drift.npz"}}))
    return RunRecord("kvdiag accuracy", "now", cases, {}, run_dir=str(tmp_path))


def peak_of_analysis(tmp_path, n):
    run = synthetic_run(tmp_path / str(n), ["auto"] + [f"d{i}" for i in range(n - 1)])
    tracemalloc.start()
    accuracy.analyze(run, baseline="auto", max_drop=0.02, alpha=0.05)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(run.analysis["accuracy"]["rows"]) == n
    return peak


@pytest.mark.slow
def test_analysis_memory_does_not_grow_with_the_number_of_dtypes(tmp_path):
    two, seven = peak_of_analysis(tmp_path, 2), peak_of_analysis(tmp_path, 7)
    assert seven < 1.25 * two, (two, seven)
