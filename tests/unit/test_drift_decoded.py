"""Decoded drift (``--drift-decoded``, kvdiag/checks/accuracy/drift_decoded.py): each dtype's own greedy continuation
scored teacher-forced by it and by the baseline dtype, compared by position; its option from one definition."""

import pytest

from kvdiag.assets import TINY_MODEL
from kvdiag.case import Case
from kvdiag.checks.accuracy import drift_decoded
from kvdiag.checks.prompts import recall_prompts
from kvdiag.checks.sweep import drift

TOKENS = 48
PROMPTS = recall_prompts()[:4]


def _case(kv_dtype):
    return Case("accuracy", "builtin", str(TINY_MODEL), kv_dtype, "",
                params={"device": "cpu", "baseline": "auto", "role": "test", "drift_decoded": TOKENS})


@pytest.fixture(scope="module")
def decoded():
    """{dtype: its probe's decoded section, rescored by the baseline dtype (auto)} and auto's own greedy tokens."""
    from kvdiag.checks.common import start_engine

    out = {}
    for dtype in ("auto", "bfloat16", "fp8_e5m2"):
        engine = start_engine(_case(dtype))
        data = {"decoded": drift_decoded.collect(engine, PROMPTS, TOKENS)}
        if dtype != "auto":
            drift_decoded.rescore(_case(dtype), engine, data, PROMPTS)
        engine.shutdown()
        out[dtype] = data
    return out


def _summary(data):
    d = {}
    drift_decoded.add(d, data)
    return d


def test_a_dtype_computed_as_the_baseline_has_zero_decoded_drift_and_no_divergence(decoded):
    d = _summary(decoded["bfloat16"])  # bfloat16 on this bf16 model: the cache auto keeps
    s = d["decoded"]
    assert s["positions"] == TOKENS * len(PROMPTS) and s["tokens"] == TOKENS
    assert s["mean_kl"] == 0 and s["max_kl"] == 0 and s["top1_agreement"] == 1
    assert s["first_divergence"] is None and s["diverged"] == 0
    assert [b["mean_kl"] for b in d["by_position"]["decoded"]] == [0, 0, 0]  # buckets 1-16, 17-32, 33-64
    assert decoded["bfloat16"]["decoded"]["tokens"] == decoded["auto"]["decoded"]["tokens"]


def test_a_perturbed_dtype_diverges_where_the_baseline_would_have_written_otherwise(decoded):
    s = _summary(decoded["fp8_e5m2"])["decoded"]
    assert s["mean_kl"] > 0 and s["top1_agreement"] < 1
    first = s["first_divergence"]
    assert first is not None and s["diverged"] >= 1
    # the oracle: the baseline's own greedy decode from the same prompt has left the dtype's tokens by then
    mine = decoded["fp8_e5m2"]["decoded"]["tokens"][first["prompt"]]
    theirs = decoded["auto"]["decoded"]["tokens"][first["prompt"]]
    assert mine[:first["position"] + 1] != theirs[:first["position"] + 1]


def test_the_decoded_section_survives_the_artifact(decoded, tmp_path):
    probe = {"over": "full", "chosen": [], "from_cache": [], "greedy": [], "greedy_logprobs": [],
             "decoded": decoded["fp8_e5m2"]["decoded"]}
    drift.save(probe, tmp_path / "x.drift.npz")
    back = drift.load(tmp_path / "x.drift.npz")
    assert back["decoded"]["tokens"] == probe["decoded"]["tokens"]
    again, before = _summary(back)["decoded"], _summary(probe)["decoded"]
    assert again.pop("first_divergence") == before.pop("first_divergence") is not None
    assert again == pytest.approx(before, rel=1e-6)
    del probe["decoded"]["base"]  # a worker that died before the baseline's scores: nothing to compare
    drift.save(probe, tmp_path / "y.drift.npz")
    assert "base" not in drift.load(tmp_path / "y.drift.npz")["decoded"] and _summary(probe) == {}


# ------------------------------------------------------------------ the option, written once


def test_the_option_reaches_the_cases_the_config_and_the_command_line(capsys):
    from kvdiag.checks.accuracy import Accuracy
    from kvdiag.checks.cases import Target
    from kvdiag.checks.registry import check_cases, toml_schema
    from kvdiag.cli.app import main

    accuracy = Accuracy()
    cases, _ = check_cases("accuracy", Target(kv_dtypes=["auto", "fp8"], device="cpu"),
                           accuracy.make({"tasks": ["kv_recall"], "drift_decoded": 64}))
    assert [(c.params["drift_decoded"], c.params["baseline"]) for c in cases] == [(64, "auto")] * 2
    plain, _ = check_cases("accuracy", Target(kv_dtypes=["auto"], device="cpu"),
                           accuracy.make({"tasks": ["kv_recall"]}))
    assert "drift_decoded" not in plain[0].params and "prefix_caching" not in plain[0].params
    check = toml_schema(accuracy)["drift_decoded"]
    assert check(128) == 128
    with pytest.raises(ValueError):
        check(-1)
    with pytest.raises(SystemExit) as e:
        main(["accuracy", "--drift-decoded", str(drift_decoded.MAX_TOKENS + 1)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--drift-decoded" in err

