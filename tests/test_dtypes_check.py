"""`kvdiag dtypes --check`: the support matrix, through the real command."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kvdiag(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from kvdiag.modelgen import make_random_model

    return str(make_random_model(tmp_path_factory.mktemp("m") / "bf16", "llama", hidden_size=64, num_layers=2,
                                 dtype="bfloat16", init_std=0.2))


def rows_of(r):
    return {x["kv_dtype"]: x for x in json.loads(r.stdout)["analysis"]["dtypes"]["rows"]}


@pytest.mark.slow
def test_builtin_matrix_passes_and_explicit_bf16_equals_auto(bf16_model, tmp_path):
    r = kvdiag("dtypes", "--check", "-m", bf16_model, "-d", "auto", "-d", "bf16", "-d", "fp16", "-d", "int8",
               "--isolate", "run", "-f", "json", "-o", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = rows_of(r)
    assert list(rows) == ["auto", "bfloat16", "float16", "int8_per_token_head"]
    assert {x["result"] for x in rows.values()} == {"pass"}
    assert rows["bfloat16"]["identical_to_auto"] is True and rows["bfloat16"]["mean_kl"] == 0
    assert rows["int8_per_token_head"]["identical_to_auto"] is None  # quantized: only drift bounds apply
    assert 0 < rows["int8_per_token_head"]["mean_kl"] < 0.01
    assert (tmp_path / "run" / "run.json").exists()


@pytest.mark.slow
def test_one_bad_dtype_never_stops_the_matrix(bf16_model, tmp_path):
    r = kvdiag("dtypes", "--check", "--engine", "tests.corrupt_engine:matrix_factory", "-m", bf16_model,
               "-d", "auto", "-d", "bf16", "-d", "e5m2", "-d", "fp8pth", "-d", "int8", "-f", "json", "-j", "2",
               "-o", str(tmp_path / "run"))
    assert r.returncode == 1, r.stderr[-3000:]
    rows = rows_of(r)
    assert {k: v["result"] for k, v in rows.items()} == {
        "auto": "pass", "bfloat16": "wrong", "fp8_e5m2": "unsupported", "fp8_per_token_head": "crashed",
        "int8_per_token_head": "pass"}
    assert rows["fp8_e5m2"]["detail"] == "fp8_e5m2 KV cache needs compute capability >= 8.9"
    assert "SIGABRT" in rows["fp8_per_token_head"]["detail"]
    assert "not bit-identical" in rows["bfloat16"]["detail"] and rows["bfloat16"]["identical_to_auto"] is False
    statuses = {c["kv_dtype"]: c["status"] for c in json.loads(r.stdout)["cases"]}
    assert statuses == {"auto": "pass", "bfloat16": "fail", "fp8_e5m2": "skipped", "fp8_per_token_head": "crashed",
                        "int8_per_token_head": "pass"}


def test_listing_is_unchanged_and_bad_input_exits_2():
    r = kvdiag("dtypes", "-f", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["kv_dtypes"][0]["name"] == "auto"
    r = kvdiag("dtypes", "--check", "-d", "int4")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "int4" in r.stderr
    r = kvdiag("dtypes", "--check", "-m", "/nonexistent/model")
    assert r.returncode == 2 and "model not found" in r.stderr


def test_refusing_the_models_own_dtype_is_wrong_not_unsupported(tmp_path):
    """Bug S1: an explicit dtype equal to the model's (what auto stores) must start; other refusals are fine."""
    import torch

    from kvdiag.checks import drift, dtypes_matrix
    from kvdiag.results import CaseResult, RunRecord

    (tmp_path / "artifacts").mkdir()
    drift.save({"over": "full", "dists": [torch.log_softmax(torch.zeros(2, 5), -1)], "chosen": [[-1.0, -1.0]],
                "greedy": [[1]], "greedy_logprobs": [[-0.1]]}, tmp_path / "artifacts" / "auto.npz")
    base = CaseResult(id="auto", check="dtypes", engine="e", model="m", kv_dtype="auto", status="pass",
                      params={"role": "baseline"}, metrics={"started": True, "finite": True, "model_dtype": "bfloat16",
                                                            "artifacts": {"drift": "auto.npz"}})

    def refused(dtype):
        rec = CaseResult(id=dtype, check="dtypes", engine="e", model="m", kv_dtype=dtype, status="skipped",
                         params={"role": "test"}, metrics={"row": "unsupported", "reason": f"no {dtype} here"})
        rec.add("info", "unsupported", f"no {dtype} here")
        return rec

    run = RunRecord("t", "t", [base, refused("bfloat16"), refused("float16"), refused("fp8_e5m2")], {},
                    run_dir=str(tmp_path))
    for _ in range(2):  # analysed again (as --resume does): the same verdict, no duplicated finding
        dtypes_matrix.analyze(run)
        rows = {r["kv_dtype"]: r for r in run.analysis["dtypes"]["rows"]}
        assert {k: v["result"] for k, v in rows.items()} == {"auto": "pass", "bfloat16": "wrong",
                                                             "float16": "unsupported", "fp8_e5m2": "unsupported"}
        assert "refused it: no bfloat16 here" in rows["bfloat16"]["detail"]
        assert [c.status for c in run.cases] == ["pass", "fail", "skipped", "skipped"]
        assert [f.kind for f in run.cases[1].findings] == ["unsupported", "wrong"]
