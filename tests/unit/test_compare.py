"""The rules of `kvdiag compare` on hand-made records, against independent oracles (scipy)."""

import pytest

from kvdiag.report.baseline import Side
from kvdiag.report.compare import compare
from kvdiag.run.runner import Case

stats = pytest.importorskip("scipy.stats")


def rec(check, dtype, status="pass", **metrics):
    return Case(check, "builtin", "/m/tiny", dtype, "x:y").result(status, metrics=metrics)


def scores(score, stderr, n=30):
    return {"kv_recall": {"acc": {"score": score, "stderr": stderr, "higher_is_better": True, "n": n}}}


def side(cases, samples=None):
    return Side("s", {c.id: c for c in cases}, samples or {})


def rows_of(result, what):
    return [r for r in result["rows"] if r["what"] == what]


def test_paired_test_when_both_sides_kept_samples():
    old = rec("accuracy", "fp8", scores=scores(1.0, 0.0))
    new = rec("accuracy", "fp8", scores=scores(20 / 30, 0.0875))
    old_s = {"kv_recall": {"acc": {str(i): 1.0 for i in range(30)}}}
    new_s = {"kv_recall": {"acc": {str(i): float(i >= 10) for i in range(30)}}}
    result = compare(side([old], {old.id: old_s}), side([new], {new.id: new_s}))
    (row,) = rows_of(result, "kv_recall acc")
    assert row["test"] == "mcnemar" and row["n"] == 30
    assert row["p_value"] == pytest.approx(stats.binomtest(0, 10, 0.5).pvalue)
    assert row["delta"] == pytest.approx(-10 / 30) and row["verdict"] == "regression" and result["regressed"]


def test_stderr_test_without_samples():
    result = compare(side([rec("accuracy", "fp8", scores=scores(0.90, 0.02))]),
                     side([rec("accuracy", "fp8", scores=scores(0.80, 0.03))]))
    (row,) = rows_of(result, "kv_recall acc")
    z = 0.10 / (0.02 ** 2 + 0.03 ** 2) ** 0.5
    assert row["test"] == "stderr" and row["p_value"] == pytest.approx(2 * stats.norm.sf(z))
    assert row["ci_low"] == pytest.approx(-0.10 - 1.959964 * 0.10 / z, rel=1e-5) and row["verdict"] == "regression"


def test_a_small_or_insignificant_change_passes():
    result = compare(side([rec("accuracy", "fp8", scores=scores(0.90, 0.05))]),
                     side([rec("accuracy", "fp8", scores=scores(0.87, 0.05))]))
    assert rows_of(result, "kv_recall acc")[0]["verdict"] == "ok" and not result["regressed"]


def test_status_changes_new_and_missing_cases():
    old = [rec("memleak", "auto"), rec("memleak", "fp8", "crashed"), rec("memleak", "int8_per_token_head")]
    new = [rec("memleak", "auto", "crashed"), rec("memleak", "fp8"), rec("memleak", "bfloat16")]
    new[0].add("error", "crashed", "worker died with SIGSEGV")
    result = compare(side(old), side(new))
    verdicts = {(r["kv_dtype"], r["verdict"]) for r in result["rows"]}
    assert verdicts == {("auto", "regression"), ("fp8", "improvement"), ("bfloat16", "new"),
                        ("int8_per_token_head", "missing")}
    assert "newly crashed: worker died with SIGSEGV" in rows_of(result, "status")[0]["message"]
    assert result["regressed"]


def test_memory_growth_and_retained_tensors():
    def mem(growth, survivors):
        return rec("memleak", "auto", threshold_mib=16.0, growth_mib={"rss": growth, "tensor_bytes": [0.0]},
                   survivor_mib=survivors)

    clean = mem([0.4, -0.2], [0.0, 0.0])
    assert not compare(side([clean]), side([mem([3.0, 9.0], [0.0, 0.0])]))["regressed"]  # noise under 16 MiB
    result = compare(side([clean]), side([mem([40.0, 41.0], [64.0, 128.0])]))
    bad = {r["what"] for r in result["rows"] if r["verdict"] == "regression"}
    assert bad == {"growth/cycle rss MiB", "retained tensor MiB"}
    assert rows_of(result, "growth/cycle rss MiB")[0]["delta"] == pytest.approx(41.0 - 0.4)
    assert compare(side([clean]), side([mem([40.0], [0.0])]), mem_tolerance_mib=50)["regressed"] is False


def test_table_and_json_render_every_verdict():
    import io
    import json

    from rich.console import Console

    from kvdiag.report.compare import render_table
    from kvdiag.results import _clean

    old = [rec("memleak", "auto"), rec("memleak", "fp8", "crashed"), rec("accuracy", "fp8", scores=scores(0.9, 0.02))]
    new = [rec("memleak", "auto", "crashed"), rec("memleak", "bfloat16"),
           rec("accuracy", "fp8", scores=scores(0.9, 0.02))]
    result = compare(side(old), side(new))
    con = Console(file=io.StringIO(), width=200)
    render_table(result, con)
    text = con.file.getvalue()
    for word in ("REGRESSED", "regression", "missing", "new", "ok", "kv_recall acc", "stderr p=1"):
        assert word in text, text
    assert json.loads(json.dumps(_clean(result)))["regressed"] is True
