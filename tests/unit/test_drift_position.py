"""Drift by position: KL and top-1 per position bucket against a direct numpy computation, the drift_grows warning on
an error that grows with the position (and not on a constant one), and the bucket table in report.md."""

import json
import re

import numpy as np
import pytest

from kvdiag.checks.sweep import drift

BUCKETS = [(1, 16), (17, 32), (33, 64), (65, 128)]  # written out: the oracle does not use the code's bucketing


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def probe(prompt_dists, long_dists) -> dict:
    """What a worker's drift.collect gives, from log-distributions made by hand ([positions, vocab] each)."""
    section = lambda ds: {"over": "full", "dists": [d.astype(np.float32) for d in ds],  # noqa: E731
                          "chosen": [d[:, 0].astype(float).tolist() for d in ds]}
    return {**section(prompt_dists), "long": section(long_dists), "greedy": [[1, 2, 3]] * len(prompt_dists),
            "greedy_logprobs": [[-0.1] * 3] * len(prompt_dists)}


def oracle(base, test) -> list[dict]:
    """Per bucket: positions, mean and max KL(base || test) and top-1 agreement, straight from the definitions."""
    out = []
    for lo, hi in BUCKETS:
        kls, agree = [], []
        for p, q in zip(base, test):
            p, q = p.astype(np.float32).astype(np.float64), q.astype(np.float32).astype(np.float64)
            for j in range(lo - 1, min(hi, len(p))):
                kls.append(float(np.sum(np.exp(p[j]) * (p[j] - q[j]))))
                agree.append(p[j][np.argmax(q[j])] >= p[j].max() - drift.TIE_NATS)
        if kls:
            out.append({"from": lo, "to": hi, "positions": len(kls), "mean_kl": np.mean(kls), "max_kl": max(kls),
                        "top1_agreement": np.mean(agree)})
    return out


def perturbed(rng, lengths, vocab, sigma):
    """Base log-distributions and the same with logit noise of standard deviation sigma(position) (0-based)."""
    base = [rng.normal(0, 2, (n, vocab)) for n in lengths]
    test = [b + rng.normal(0, 1, b.shape) * sigma(np.arange(len(b)))[:, None] for b in base]
    return [log_softmax(b) for b in base], [log_softmax(t) for t in test]


def assert_buckets(got, want):
    assert [(r["from"], r["to"], r["positions"]) for r in got] == [(r["from"], r["to"], r["positions"]) for r in want]
    for g, w in zip(got, want):
        assert g["mean_kl"] == pytest.approx(w["mean_kl"], rel=1e-5, abs=1e-9)
        assert g["max_kl"] == pytest.approx(w["max_kl"], rel=1e-5, abs=1e-9)
        assert g["top1_agreement"] == pytest.approx(w["top1_agreement"])


def test_buckets_match_a_direct_numpy_computation(tmp_path):
    """Continuations of 10, 40 and 70 tokens (buckets 1-16 to 65-128), vocabulary 11: every bucket's KL and top-1
    as numpy computes them per position; the long section's the same after save/load (its top-16 holds all 11)."""
    rng = np.random.default_rng(0)
    pb, pt = perturbed(rng, [10, 40, 70], 11, lambda t: 0.3 + 0.0 * t)
    lb, lt = perturbed(rng, [128, 100], 11, lambda t: 0.05 + 0.01 * t)
    d = drift.compare(probe(pb, lb), probe(pt, lt))
    assert_buckets(d["by_position"]["prompts"], oracle(pb, pt))
    assert_buckets(d["by_position"]["long"], oracle(lb, lt))
    assert d["by_position"]["prompts"][1]["top1_agreement"] < 1  # the noise flips some top-1s: the count is tested
    assert d["positions"] == 120 and d["mean_kl"] == pytest.approx(
        sum(r["mean_kl"] * r["positions"] for r in oracle(pb, pt)) / 120, rel=1e-5)  # the totals: the prompts only
    drift.save(probe(pb, lb), tmp_path / "b.npz")
    drift.save(probe(pt, lt), tmp_path / "t.npz")
    loaded = drift.compare(drift.load(tmp_path / "b.npz"), drift.load(tmp_path / "t.npz"))
    assert_buckets(loaded["by_position"]["long"], oracle(lb, lt))
    assert loaded["by_position"]["prompts"] == d["by_position"]["prompts"]


def growth_case(sigma):
    rng = np.random.default_rng(1)
    pb, pt = perturbed(rng, [30] * 4, 11, lambda t: 0.05 + 0.0 * t)  # the prompts: a small constant error
    lb, lt = perturbed(rng, [128] * 4, 11, sigma)
    return probe(pb, lb), probe(pt, lt)


GROWING = lambda t: 0.05 + 0.6 * t / 128  # noqa: E731 - logit noise from 0.05 to 0.65 over 128 positions
CONSTANT = lambda t: 0.15 + 0.0 * t  # noqa: E731


def test_growth_is_flagged_and_a_constant_error_is_not():
    lim = drift.limits_for("fp8", "bfloat16")
    for sigma, grows in ((GROWING, True), (CONSTANT, False)):
        base, test = growth_case(sigma)
        d = drift.compare(base, test)
        assert drift.judge(d, lim) == []  # the totals pass either way
        found = drift.grows(d, lim)
        assert [e["section"] for _, e in found] == (["long"] if grows else [])
        if grows:
            first, last = d["by_position"]["long"][0], d["by_position"]["long"][-1]
            assert last["mean_kl"] > 4 * first["mean_kl"] and last["mean_kl"] > lim.mean_kl
            assert "positions 1-16" in found[0][0] and "65-128" in found[0][0]


def test_growth_rule_edges():
    from kvdiag.checks.sweep.drift_position import grows

    def rows(*kls, n=16):
        return [{"from": 0, "to": 0, "positions": n, "mean_kl": k} for k in kls]
    assert grows(rows(0.0, 0.0, 0.05), 0.02)["ratio"] is None  # from 0: growth, the ratio undefined
    assert grows(rows(0.0, 0.0, 0.0), 0.0) is None  # bit-identical all along
    assert grows(rows(0.01, 0.05), 0.02) is not None
    assert grows(rows(0.01, 0.039), 0.02) is None  # 3.9x
    assert grows(rows(0.001, 0.015), 0.02) is None  # 15x but under the limit
    assert grows(rows(0.01, float("nan")), 0.02) is None  # NaN: the drift limits fail it, not this
    assert grows(rows(0.01) + rows(0.5, n=7), 0.02) is None  # a last bucket of 7 positions is not judged


def accuracy_run(tmp_path, sigma):
    """An analysed accuracy run of auto and fp8 whose fp8 drift probe has the long section's error ``sigma``."""
    from accuracy_runs import case

    from kvdiag.checks.accuracy import verdict as accuracy
    from kvdiag.results import RunRecord, exit_code_for, summarize, write_jsonl, write_run_json

    base, test = growth_case(sigma)
    cases = []
    for dtype, p in (("auto", base), ("fp8", test)):
        cases.append(case(tmp_path, dtype, []))
        drift.save(p, tmp_path / "artifacts" / f"{dtype}.drift.npz")
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(c.to_json()) + "\n" for c in cases))
    run = RunRecord(command="kvdiag accuracy", started="2026-11-25T10:00:00+00:00", cases=cases, environment={},
                    run_dir=str(tmp_path), finished="2026-11-25T10:01:00+00:00")
    accuracy.analyze(run, baseline="auto", max_drop=0.02, alpha=0.05)
    run.summary, run.exit_code = summarize(run.cases), exit_code_for(run.cases)
    write_jsonl(tmp_path / "results.jsonl", run.cases)  # as the runner does once the run is judged
    write_run_json(tmp_path, run)
    return run


def test_accuracy_warns_drift_grows_passes_and_reports_the_buckets(tmp_path):
    from kvdiag.checks.accuracy import verdict as accuracy
    from kvdiag.report.markdown import render_markdown

    run = accuracy_run(tmp_path, GROWING)
    fp8 = run.cases[1]
    assert fp8.status == "pass" and run.exit_code == 0  # a warning: the verdict is unchanged
    # the fixture's few documents also make it an inconclusive pass (issue 48); the growth is the warning here
    grown = [f for f in fp8.findings if f.kind != "inconclusive"]
    assert [(f.severity, f.kind) for f in grown] == [("warning", "drift_grows")]
    assert grown[0].evidence["section"] == "long"
    saved = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [b["from"] for b in saved[-1]["metrics"]["drift"]["by_position"]["long"]] == [1, 17, 33, 65]
    md = render_markdown(run)
    assert "## Drift by position vs the baseline dtype" in md
    assert "| kv dtype | scored | 1-16 | 17-32 | 33-64 | 65-128 | KL grows |" in md
    first, last = run.analysis["accuracy"]["drift_by_position"][0]["by_position"]["long"][::3]
    row = next(line for line in md.splitlines() if line.startswith("| fp8 | long continuation |"))
    assert f"| {last['mean_kl']:.2g} / {last['top1_agreement']:.3f} |" in row
    assert row.endswith(f"| yes, {last['mean_kl'] / first['mean_kl']:.1f}x |")
    accuracy.analyze(run, baseline="auto", max_drop=0.02, alpha=0.05)  # analysed again (--resume): still one
    assert [f.kind for f in run.cases[1].findings if f.kind != "inconclusive"] == ["drift_grows"]


def test_terminal_and_html_show_the_growth(tmp_path):
    from rich.console import Console

    from kvdiag.checks.accuracy.view import render as accuracy
    from kvdiag.report.html import render_html

    run = accuracy_run(tmp_path, GROWING)
    con = Console(width=80, record=True, color_system=None)
    accuracy(run, con)
    text = con.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    row = next(line for line in text.splitlines() if line.startswith("│ fp8 "))
    spark = re.search(r"([▁▂▃▄▅▆▇█]{4}) grows (\d+\.\d)x", row)
    assert spark and spark[1][0] < spark[1][-1]  # rises from the first bucket to the last
    html = render_html(run)
    assert "Drift by position vs the baseline dtype" in html  # the table
    assert "<title>drift by position along the long continuations</title>" in html  # the plot


def test_a_constant_error_passes_without_a_warning(tmp_path):
    from kvdiag.report.markdown import render_markdown

    run = accuracy_run(tmp_path, CONSTANT)
    assert run.cases[1].status == "pass" and [f for f in run.cases[1].findings if f.kind != "inconclusive"] == []
    row = next(line for line in render_markdown(run).splitlines() if line.startswith("| fp8 | long continuation |"))
    assert row.endswith("| no |")


def test_dtypes_check_names_the_growth_in_the_row(tmp_path):
    from kvdiag.checks.dtypes import verdict as dtypes_matrix
    from kvdiag.results import CaseResult, RunRecord

    (tmp_path / "artifacts").mkdir()
    cases = []
    for dtype, p in zip(("auto", "fp8"), growth_case(GROWING)):
        drift.save(p, tmp_path / "artifacts" / f"{dtype}.npz")
        cases.append(CaseResult(id=dtype, check="dtypes", engine="e", model="m", kv_dtype=dtype, status="pass",
                                params={"role": "baseline" if dtype == "auto" else "test"},
                                metrics={"started": True, "finite": True, "model_dtype": "bfloat16",
                                         "artifacts": {"drift": f"{dtype}.npz"}}))
    run = RunRecord("t", "t", cases, {}, run_dir=str(tmp_path))
    dtypes_matrix.analyze(run)
    row = run.analysis["dtypes"]["rows"][1]
    assert row["result"] == "pass" and "KL grows with the position along the long continuations" in row["detail"]
    assert [f.kind for f in cases[1].findings] == ["drift_grows"]
