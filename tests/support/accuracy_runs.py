"""A finished `kvdiag accuracy` run without an engine: both shipped recall tasks (acc and acc_norm) for every builtin
kv dtype, per-document samples and drift probes written as the workers write them, judged by the real analysis."""

import json

import torch

from kvdiag.checks.accuracy import verdict as accuracy
from kvdiag.checks.sweep import drift
from kvdiag.results import CaseResult, RunRecord, exit_code_for, summarize, write_run_json

DTYPES = ["auto", "bfloat16", "float16", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"]
TASKS = ("kv_recall", "kv_recall_long")
N = 40


def documents(dtype: str, task: str, metric: str) -> list[float]:
    """Per-document 0/1 scores: fp8_e5m2 loses 12 right answers of kv_recall_long's acc_norm, the rest recall as the
    baseline (30 of 40 right; acc_norm 28)."""
    right = 30 if metric == "acc" else 28
    docs = [1.0] * right + [0.0] * (N - right)
    if (dtype, task, metric) == ("fp8_e5m2", "kv_recall_long", "acc_norm"):
        docs[:12] = [0.0] * 12
    return docs


def case(run_dir, dtype: str, dists) -> CaseResult:
    rec = CaseResult(id=f"accuracy/builtin/tiny-llama/{dtype}", check="accuracy", engine="builtin",
                     model="/m/tiny-llama", kv_dtype=dtype, status="pass", duration_s=2.0,
                     params={"role": "baseline" if dtype == "auto" else "test"})
    art = run_dir / "artifacts"
    art.mkdir(exist_ok=True)
    samples, scores = {}, {}
    for task in TASKS:
        for metric in ("acc", "acc_norm"):
            docs = documents(dtype, task, metric)
            samples.setdefault(task, {})[metric] = {str(i): v for i, v in enumerate(docs)}
            p = sum(docs) / N
            scores.setdefault(task, {})[metric] = {"score": p, "stderr": (p * (1 - p) / (N - 1)) ** 0.5,
                                                   "higher_is_better": True, "n": N}
    (art / f"{dtype}.samples.json").write_text(json.dumps(samples))
    drift.save({"over": "full", "dists": [d.clone() for d in dists], "greedy": [[1, 2, 3]] * len(dists),
                "chosen": [[-0.5] * d.shape[0] for d in dists], "greedy_logprobs": [[-0.1] * 3] * len(dists)},
               art / f"{dtype}.drift.npz")
    rec.metrics = {"scores": scores, "model_dtype": "bfloat16", "finite": True,
                   "artifacts": {"samples": f"{dtype}.samples.json", "drift": f"{dtype}.drift.npz"}}
    return rec


def recall_run(run_dir) -> RunRecord:
    """The run, analysed, with results.jsonl and run.json in ``run_dir`` (what `kvdiag report RUN` reads)."""
    g = torch.Generator().manual_seed(0)
    base = [torch.log_softmax(3 * torch.randn(5, 11, generator=g), -1) for _ in range(3)]
    cases = []
    for i, dtype in enumerate(DTYPES):
        exact = dtype in ("auto", "bfloat16")
        dists = base if exact else [torch.log_softmax(d + 0.01 * i * torch.randn(d.shape, generator=g), -1)
                                    for d in base]
        cases.append(case(run_dir, dtype, dists))
    (run_dir / "results.jsonl").write_text("".join(json.dumps(c.to_json()) + "\n" for c in cases))
    run = RunRecord(command="kvdiag accuracy", started="2026-11-25T10:00:00+00:00", cases=cases,
                    environment={"kvdiag": "0.1.0", "torch": "2.13.0", "device": "cpu"}, run_dir=str(run_dir),
                    finished="2026-11-25T10:01:00+00:00")
    accuracy.analyze(run, baseline="auto", max_drop=0.02, alpha=0.05)
    run.summary, run.exit_code = summarize(run.cases), exit_code_for(run.cases)
    write_run_json(run_dir, run)
    return run
