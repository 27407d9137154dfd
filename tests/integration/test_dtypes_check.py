"""`kvdiag dtypes --check`: the support matrix, through the real command."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kvdiag(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from kvdiag.models.gen import make_random_model

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
    r = kvdiag("dtypes", "--check", "--engine", "tests.support.corrupt_engine:matrix_factory", "-m", bf16_model,
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
    assert statuses == {"auto": "pass", "bfloat16": "fail", "fp8_e5m2": "unsupported", "fp8_per_token_head": "crashed",
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

    from kvdiag.checks.dtypes import verdict as dtypes_matrix
    from kvdiag.checks.sweep import drift
    from kvdiag.results import CaseResult, RunRecord

    (tmp_path / "artifacts").mkdir()
    drift.save({"over": "full", "dists": [torch.log_softmax(torch.zeros(2, 5), -1)], "chosen": [[-1.0, -1.0]],
                "greedy": [[1]], "greedy_logprobs": [[-0.1]]}, tmp_path / "artifacts" / "auto.npz")
    base = CaseResult(id="auto", check="dtypes", engine="e", model="m", kv_dtype="auto", status="pass",
                      params={"role": "baseline"}, metrics={"started": True, "finite": True, "model_dtype": "bfloat16",
                                                            "artifacts": {"drift": "auto.npz"}})

    def refused(dtype):
        rec = CaseResult(id=dtype, check="dtypes", engine="e", model="m", kv_dtype=dtype, status="unsupported",
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
        assert [c.status for c in run.cases] == ["pass", "fail", "unsupported", "unsupported"]
        assert [f.kind for f in run.cases[1].findings] == ["unsupported", "wrong"]


@pytest.mark.slow
def test_out_of_device_memory_is_a_resource_row_never_unsupported(bf16_model, tmp_path):
    """vLLM on one GPU shared by engines starting together: 'No available memory for the cache blocks' (a
    ValueError at start) and its memory-profiling AssertionError are errors of the run, exit 1. The same engine's
    'fp8' cache is bf16 in one of the model's 2 layers: a warning, and the row still passes."""
    r = kvdiag("dtypes", "--check", "--engine", "tests.support.cache_engines:factory", "-m", bf16_model, "-d", "auto",
               "-d", "fp16", "-d", "e5m2", "-d", "fp8", "-f", "json", "-j", "2",
               "-o", str(tmp_path / "run"))
    assert r.returncode == 1, r.stderr[-3000:]
    rows = rows_of(r)
    assert {k: v["result"] for k, v in rows.items()} == {
        "auto": "pass", "float16": "resource", "fp8_e5m2": "resource", "fp8": "pass"}
    assert rows["float16"]["detail"].startswith("ValueError: No available memory for the cache blocks")
    assert rows["fp8_e5m2"]["detail"].startswith("AssertionError: Error in memory profiling")
    cases = {c["kv_dtype"]: c for c in json.loads(r.stdout)["cases"]}
    for d in ("float16", "fp8_e5m2"):
        assert cases[d]["status"] == "error" and [f["kind"] for f in cases[d]["findings"]] == ["resource"]
    assert cases["fp8"]["status"] == "pass"
    assert [(f["severity"], f["kind"]) for f in cases["fp8"]["findings"]] == [("warning", "not_quantized")]
    assert "stores 1 of 2 layers at the model's precision (bfloat16)" in cases["fp8"]["findings"][0]["message"]
    assert rows["fp8"]["stores"] == "fp8_e4m3 (1/2 layers), bf16 (1/2 layers)"
    assert rows["fp8"]["not_quantized"] in rows["fp8"]["detail"]
    assert not cases["auto"]["findings"] and rows["auto"]["not_quantized"] is None


@pytest.mark.slow
def test_the_matrix_shows_what_the_cache_stores(tmp_path):
    """Shipped tiny model, builtin engine: int8 stores 1-byte codes and per-token scales, auto the model's bf16;
    bytes per token from the model's config."""
    from kvdiag.assets import TINY_MODEL

    cfg = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    per_byte = layers * heads * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    r = kvdiag("dtypes", "--check", "-d", "auto", "-d", "int8_per_token_head", "-d", "fp8", "-f", "json", "-j", "2",
               "-o", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = rows_of(r)
    st = {k: v["storage"] for k, v in rows.items()}
    assert st["int8_per_token_head"]["layer_dtypes"] == ["int8"] * layers
    assert st["int8_per_token_head"]["element_bytes"] == {"int8": 1} and st["int8_per_token_head"]["scales"]
    assert st["int8_per_token_head"]["k_bytes_per_token"] == st["int8_per_token_head"]["v_bytes_per_token"] == per_byte
    assert st["int8_per_token_head"]["scale_bytes_per_token"] == 2 * layers * heads * 4  # float32 per token and head
    assert rows["int8_per_token_head"]["stores"] == "int8 +scales"
    assert st["fp8"]["k_bytes_per_token"] == per_byte and not st["fp8"]["scales"]
    assert rows["fp8"]["stores"] == "fp8_e4m3"
    assert st["auto"]["k_bytes_per_token"] == 2 * per_byte and st["auto"]["layers"] == layers
    assert rows["auto"]["stores"] == "bf16" and rows["auto"]["kv_bytes_per_token"] == 4 * per_byte
    assert {v["not_quantized"] for v in rows.values()} == {None}
    # the storage audit: every layer full attention, counted, with its dtype and bytes per token of one layer
    assert rows["auto"]["layers"] == f"{layers} full bf16 {4 * per_byte // layers} B/token"
    int8_layer = (2 * per_byte + 2 * layers * heads * 4) // layers
    assert rows["int8_per_token_head"]["layers"] == f"{layers} full int8+scales {int8_layer} B/token"
    from rich.console import Console

    from kvdiag.checks.dtypes.view import render as _render
    from kvdiag.results import load_run

    con = Console(record=True, width=250)
    _render(load_run(tmp_path / "run"), con)
    table = con.export_text()
    assert "stores" in table and "int8 +scales" in table and f"{2 * per_byte} +{2 * layers * heads * 4}" in table
    assert f"{layers} full int8+scales {int8_layer} B/token" in table.replace("\n", "")
    from kvdiag.report.markdown import render_markdown

    assert f"| int8_per_token_head | pass | int8 +scales | {layers} full int8+scales {int8_layer} B/token |" in (
        render_markdown(load_run(tmp_path / "run")))
