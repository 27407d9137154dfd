"""The reproducer of an accuracy score regression (kvdiag/checks/accuracy/repro.py): the documents whose score
changed, scored again by lm_eval's vLLM backend once per dtype with each engine's arguments; exit 1 when the dtype
loses at least half of what kvdiag saw over them. lm_eval and vLLM are stand-ins (tests/support/fake_lm_eval,
fake_vllm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.case import Case
from kvdiag.results import RunRecord

SUPPORT = Path(__file__).resolve().parents[1] / "support"
SCORES = {"kv_recall": {"acc": {"score": 0.5, "higher_is_better": True}}}


def recorded(tmp_path) -> tuple[RunRecord, object]:
    """A baseline and an fp8 case as accuracy records them, the fp8 one failed: it lost documents 1, 3 and 5."""
    art = tmp_path / "artifacts"
    art.mkdir()
    recs = []
    for kv, role, lost in (("auto", "baseline", ()), ("fp8", "test", ("1", "3", "5"))):
        name = f"{kv}.samples.json"
        (art / name).write_text(json.dumps({"kv_recall": {"acc": {str(d): 0.0 if str(d) in lost else 1.0
                                                                  for d in range(8)}}}))
        rec = Case("accuracy", "vllm", "/m", kv, "t", params={"role": role, "tasks": ["kv_recall"], "seed": 0},
                   id=f"accuracy/vllm/m/{kv}").result(
            "fail" if lost else "pass", metrics={"scores": SCORES, "artifacts": {"samples": name},
                                                 "replay": {"engine": "vllm", "llm": {"model": "/m",
                                                            "kv_cache_dtype": kv}, "sampling": {}, "env": {}}})
        recs.append(rec)
    recs[1].add("error", "regression", "kv_recall acc: 0.625 vs baseline 1 (Δ -0.375, p=0.03)", task="kv_recall",
                metric="acc")
    return RunRecord("kvdiag accuracy -e vllm -d auto -d fp8", "", recs, {}, run_dir=str(tmp_path)), recs[1]


@pytest.mark.parametrize("fault, code", [("flip", 1), (None, 0)])
def test_the_script_scores_the_changed_documents_by_both_dtypes(tmp_path, fault, code):
    from kvdiag.checks.accuracy.repro import script

    run, rec = recorded(tmp_path)
    text = script(rec, run)
    assert "import kvdiag" not in text and "from kvdiag" not in text
    (tmp_path / "r.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": f"{SUPPORT / 'fake_lm_eval'}{os.pathsep}{SUPPORT / 'fake_vllm'}",
           **({"FAKE_LM_EVAL_FAULT": fault} if fault else {})}
    p = subprocess.run([sys.executable, str(tmp_path / "r.py")], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == code, p.stdout + p.stderr
    assert "  1: 1 -> 0; now 1 -> " in p.stdout and "in kvdiag's run 3" in p.stdout
    ns: dict = {"__name__": "reproducer"}
    exec(compile(text, "r.py", "exec"), ns)
    assert list(ns["CASE"]["documents"]) == ["1", "3", "5"]  # only the documents that changed
    assert [e["llm"]["kv_cache_dtype"] for e in ns["CASE"]["engines"]] == ["auto", "fp8"]


def test_no_script_for_a_case_failed_on_drift_alone(tmp_path):
    from kvdiag.checks.accuracy.repro import script

    run, rec = recorded(tmp_path)
    rec.findings = []
    rec.add("error", "drift", "drift (fp8): mean KL 0.3 > 0.1")
    assert script(rec, run) is None


def inline_run(tmp_path):
    """``recorded``, with the baseline's requests artifact: each document a yes/no choice, the gold one first."""
    import gzip

    run, rec = recorded(tmp_path)
    docs = {str(d): {"type": "multiple_choice", "gold": 0, "chars": [3, 2],
                     "arguments": [[f"doc {d}: is it?", " yes"], [f"doc {d}: is it?", " no"]]} for d in range(8)}
    with gzip.open(tmp_path / "artifacts" / "auto.requests.json.gz", "wt") as f:
        json.dump({"kv_recall": docs}, f)
    run.cases[0].metrics["artifacts"]["requests"] = "auto.requests.json.gz"
    return run, rec


@pytest.mark.parametrize("fault, code", [("flip", 1), (None, 0)])
def test_a_multiple_choice_regression_carries_its_documents_inline_and_needs_no_task_folder(tmp_path, fault, code):
    """The changed documents' requests, as lm_eval made them, are in the script: it scores them by lm_eval's vLLM
    backend where neither kvdiag's task folder nor any dataset is (lm_eval.tasks cannot be imported)."""
    from kvdiag.checks.accuracy.repro import script

    run, rec = inline_run(tmp_path)
    text = script(rec, run)
    ns: dict = {"__name__": "reproducer"}
    exec(compile(text, "r.py", "exec"), ns)
    assert list(ns["CASE"]["requests"]) == ["1", "3", "5"] and "include_path" not in ns["CASE"]
    assert ns["CASE"]["requests"]["3"]["arguments"] == [["doc 3: is it?", " yes"], ["doc 3: is it?", " no"]]
    (tmp_path / "r.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": f"{SUPPORT / 'fake_lm_eval'}{os.pathsep}{SUPPORT / 'fake_vllm'}",
           "FAKE_LM_EVAL_NO_TASKS": "1", **({"FAKE_LM_EVAL_FAULT": fault} if fault else {})}
    p = subprocess.run([sys.executable, str(tmp_path / "r.py")], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == code, p.stdout + p.stderr
    assert "  3: 1 -> 0; now 1 -> " + ("0" if fault else "1") in p.stdout


def test_kvdiag_keeps_what_lm_eval_scored_each_loglikelihood_document_by():
    """lm_eval's requests per document of a multiple-choice task, its gold choice as lm_eval reads a target (an
    index, a choice's text, several), each choice's length without the delimiter; a generation task, and a document
    whose gold is not among its choices, are left out."""
    from kvdiag.checks.accuracy.harness.lm_eval_results import requests

    def row(d, target, choices=(" a", " bb")):
        return {"doc_id": d, "target": target, "arguments": [("ctx", c) for c in choices]}

    res = {"configs": {"mc": {"output_type": "multiple_choice", "target_delimiter": " "},
                       "gen": {"output_type": "generate_until"}},
           "samples": {"mc": [row(0, 1), row(1, "a"), row(2, [0, 1]), row(3, "zz")], "gen": [row(0, "x")]}}
    got = requests(res)
    assert list(got) == ["mc"] and list(got["mc"]) == ["0", "1", "2"]
    assert [got["mc"][d]["gold"] for d in "012"] == [1, 0, [0, 1]]
    assert got["mc"]["0"] == {"type": "multiple_choice", "arguments": [["ctx", " a"], ["ctx", " bb"]], "gold": 1,
                              "chars": [1, 2]}
