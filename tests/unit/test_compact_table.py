"""The accuracy table stays readable for a real suite: one row per dtype x task or task group, the primary metric,
drift once per dtype; groups weighted by documents as lm_eval aggregates them (numpy as the oracle)."""

import io

import numpy as np
from rich.console import Console

from kvdiag.checks.accuracy.harness.lm_eval_results import task_groups
from kvdiag.checks.accuracy.view import render as accuracy
from kvdiag.render.compact import compact_rows
from kvdiag.results import CaseResult, RunRecord

DTYPES = ["auto", "bfloat16", "float16", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"]
SUBJECTS = [f"mmlu_s{i}" for i in range(57)]


def mmlu_rows(seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for d in DTYPES:
        for s in SUBJECTS:
            n = int(rng.integers(100, 400))
            for metric in ("acc", "acc_norm"):
                score, base = rng.random(), rng.random()
                verdict = "baseline" if d == "auto" else ("regression" if (s == "mmlu_s3" and d == "fp8") else "ok")
                rows.append({"kv_dtype": d, "task": s, "metric": metric, "score": score, "stderr": 0.01, "n": n,
                             "baseline": None if d == "auto" else base, "delta": None if d == "auto" else score - base,
                             "ci_low": -0.1, "ci_high": 0.1, "p_value": 0.5, "verdict": verdict, "mean_kl": 0.01,
                             "max_kl": 0.1, "top1_agreement": 0.99})
    return rows


def test_mmlu_over_seven_dtypes_is_seven_rows_weighted_by_documents():
    rows = mmlu_rows()
    groups = task_groups({"mmlu": ["mmlu_stem", "mmlu_rest"], "mmlu_stem": SUBJECTS[:20], "mmlu_rest": SUBJECTS[20:],
                          **{s: [] for s in SUBJECTS}})
    out = compact_rows(rows, groups)
    assert len(rows) == 798 and len(out) == 7
    for d, r in zip(DTYPES, out):
        mine = [x for x in rows if x["kv_dtype"] == d and x["metric"] == "acc"]
        n = np.array([x["n"] for x in mine], dtype=float)
        assert r["task"] == "mmlu (57 tasks)" and r["metric"] == "acc" and r["n"] == n.sum()
        assert np.isclose(r["score"], np.average([x["score"] for x in mine], weights=n))
        if d != "auto":
            assert np.isclose(r["delta"], np.average([x["delta"] for x in mine], weights=n))
    fp8 = out[DTYPES.index("fp8")]
    assert fp8["verdict"] == "regression" and fp8["message"] == "1 of 57 tasks"
    assert out[1]["verdict"] == "ok" and out[0]["verdict"] == "baseline"


def test_primary_metric_and_drift_once_per_dtype():
    rows = [{"kv_dtype": d, "task": t, "metric": m, "score": 0.5, "stderr": 0.1, "n": 10, "verdict": "ok",
             "mean_kl": 0.2, "max_kl": 0.3, "top1_agreement": 0.9}
            for d in ("auto", "fp8") for t in ("kv_recall", "kv_recall_long") for m in ("acc", "acc_norm")]
    rows.append({"kv_dtype": "int8", "task": "-", "metric": "-", "verdict": "crashed", "message": "boom"})
    out = compact_rows(rows)
    assert [(r["kv_dtype"], r["task"], r["metric"]) for r in out] == [
        ("auto", "kv_recall", "acc"), ("auto", "kv_recall_long", "acc"), ("fp8", "kv_recall", "acc"),
        ("fp8", "kv_recall_long", "acc"), ("int8", "-", "-")]
    assert [r["mean_kl"] for r in out[:4]] == [0.2, None, 0.2, None]
    run = RunRecord("kvdiag accuracy", "now", [CaseResult("a", "accuracy", "builtin", "m", "auto", "pass")], {},
                    analysis={"accuracy": {"baseline": "auto", "max_drop": 0.02, "alpha": 0.05, "rows": rows}})
    buf = io.StringIO()
    accuracy(run, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "acc_norm" not in text and "9 rows (every task and metric)" in text and "boom" in text
    assert text.count("0.2 / 0.3") == 2  # the drift of auto and of fp8, each once
