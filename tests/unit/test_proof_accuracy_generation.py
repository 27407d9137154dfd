"""A generation task's score-regression reproducer (kvdiag/checks/accuracy/repro.py, lm_eval_docs_script.py): each
flipped document's request, the document and the task's scoring carried inline, and the answers scored as the task
scores them. The oracle is lm_eval itself: its evaluator's per-document values, over the task loaded from its YAML
and dataset, of the same answers (a stand-in model gives them). vLLM is a stand-in (tests/support/fake_vllm)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.case import Case
from kvdiag.results import RunRecord

SUPPORT = Path(__file__).resolve().parents[1] / "support"
DOCS = list(range(12))

FILTERED = """\
task: gen_filtered
custom_dataset: !function gen_data.load
test_split: test
output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 16, do_sample: false}
filter_list:
  - name: strict
    filter: [{function: regex, regex_pattern: "#### (\\\\-?[0-9]+)"}, {function: take_first}]
  - name: flexible
    filter: [{function: regex, group_select: -1, regex_pattern: "(-?[0-9]+)"}, {function: take_first}]
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}
metadata: {version: 1.0}
"""
DATA = """def load(**_):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(
        [{"question": f"{i} + 1", "answer": str(i + 1)} for i in range(12)])})
"""


def answer(doc: dict, doc_id: int) -> str:
    """Right, half right or wrong by the document's number: kv_decode's turns (kvdiag/tasks/kv_turns.py: the last
    turn wrong, or missing), gen_filtered's number (in the strict format, in another, a wrong one)."""
    from kvdiag.tasks.kv_turns import TURN

    if "answers" in doc:
        turns = list(doc["answers"])
        turns = [turns, turns[:-1] + [turns[-1][:-1] + "x"], turns[:-1]][doc_id % 3]
        return TURN.join(turns)
    right = int(doc["answer"])
    return [f"#### {right}", f"it is {right}.", f"#### {right + 1}"][doc_id % 3]


def evaluated(task: str, include: tuple = (), right=False) -> tuple[dict, object]:
    """lm_eval's results of ``task``'s first documents answered by ``answer`` (every one right: ``right``), and
    the task object lm_eval scored them with."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM

    from kvdiag.checks.accuracy.harness.lm_eval_adapter import _Loaded
    from kvdiag.tasks import task_manager

    class Canned(LM):
        def generate_until(self, requests, disable_tqdm=False):
            return [answer(r.doc, 0 if right else r.doc_id) for r in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        loglikelihood_rolling = loglikelihood

    tm = _Loaded(task_manager(include, False), None)
    res = simple_evaluate(model=Canned(), tasks=[task], task_manager=tm, log_samples=True,
                          samples={task: DOCS}, bootstrap_iters=0)
    return res, tm.got["tasks"][task]


@pytest.fixture(scope="module")
def kv_decode():
    return evaluated("kv_decode")


@pytest.fixture
def filtered(tmp_path):
    (tmp_path / "gen_filtered.yaml").write_text(FILTERED)
    (tmp_path / "gen_data.py").write_text(DATA)
    return evaluated("gen_filtered", (str(tmp_path),))


@pytest.mark.parametrize("which", ["kv_decode", "filtered"])
def test_the_carried_scoring_scores_each_answer_as_lm_eval_scored_it(which, request):
    """kv_decode (a custom process_results of kvdiag's task folder) and a task of regex filters and exact_match
    options: from the carried config and documents alone, every metric under every filter of every document equals
    lm_eval's own value of the same answer."""
    from kvdiag.checks.accuracy.harness.lm_eval_generations import generations, scoring
    from kvdiag.checks.accuracy.harness.lm_eval_results import summarize
    from kvdiag.proof.lm_eval_docs_script import scored, task_of

    res, task = request.getfixturevalue(which)
    name = task.config.task
    kept, carried = generations(res)[name], json.loads(json.dumps(scoring(task)))
    assert "config" in carried
    oracle = summarize(res)["samples"][name]
    assert set(oracle) == ({"exact_match,strict", "exact_match,flexible"} if which == "filtered" else
                           {"exact_match", *(f"exact_match_len{n}" for n in (1, 2, 4, 8, 16))})
    for metric, values in oracle.items():
        docs = {d: kept[d]["doc"] for d in values}
        got = scored(task_of(carried, list(docs.values())), metric, docs, {d: kept[d]["response"] for d in values})
        assert got == values, metric
    assert set(oracle["exact_match" if which == "kv_decode" else "exact_match,strict"].values()) == {0.0, 1.0}
    if which == "filtered":  # the filters decide: the loose one takes "it is 3." as right, the strict one not
        assert oracle["exact_match,flexible"]["1"] == 1.0 and oracle["exact_match,strict"]["1"] == 0.0


def recorded(tmp_path, fault: str | None = None) -> tuple[RunRecord, object, list[str]]:
    """A baseline and an fp8 case of kv_decode as accuracy records them: the baseline answered every document right
    (its requests artifact as the worker writes it), the fp8 one lost three whose first turn's characters sum to an
    even number (the stand-in vLLM's ``token`` fault changes those answers)."""
    from types import SimpleNamespace

    from kvdiag.checks.accuracy.harness.lm_eval_adapter import generation_requests
    from kvdiag.tasks.kv_turns import TURN

    res, task = evaluated("kv_decode", right=True)
    got = generation_requests(res, {"kv_decode": task}, SimpleNamespace(max_length=4096, max_gen_toks=256))
    kept = got["kv_decode"]
    lost = [d for d in kept if sum(map(ord, kept[d]["arguments"][0][0].split(TURN)[0])) % 2 == 0][:3]
    art = tmp_path / "artifacts"
    art.mkdir()
    with gzip.open(art / "auto.requests.json.gz", "wt") as f:
        json.dump(got, f)
    recs = []
    for kv, role in (("auto", "baseline"), ("fp8", "test")):
        values = {d: 0.0 if kv == "fp8" and d in lost else 1.0 for d in kept}
        (art / f"{kv}.samples.json").write_text(json.dumps({"kv_decode": {"exact_match": values}}))
        llm = {"model": "/m", "kv_cache_dtype": kv, **({"fake_fault": fault} if fault and kv == "fp8" else {})}
        rec = Case("accuracy", "vllm", "/m", kv, "t", params={"role": role, "tasks": ["kv_decode"], "seed": 0},
                   id=f"accuracy/vllm/m/{kv}").result("fail" if role == "test" else "pass", metrics={
                       "scores": {"kv_decode": {"exact_match": {"score": 0.75, "higher_is_better": True}}},
                       "artifacts": {"samples": f"{kv}.samples.json",
                                     **({"requests": "auto.requests.json.gz"} if role == "baseline" else {})},
                       "replay": {"engine": "vllm", "llm": llm, "sampling": {}, "env": {}}})
        recs.append(rec)
    recs[1].add("error", "regression", "kv_decode exact_match: 0.75 vs baseline 1", task="kv_decode",
                metric="exact_match")
    return RunRecord("kvdiag accuracy -e vllm -d auto -d fp8 -t kv_decode", "", recs, {}, run_dir=str(tmp_path)), \
        recs[1], lost


@pytest.mark.parametrize("fault, code", [("token", 1), (None, 0)])
def test_a_generation_regression_carries_its_documents_and_scoring_inline(tmp_path, fault, code):
    """The flipped documents' rendered requests and the task's scoring are in the script; it answers them with
    vLLM turn by turn, as kvdiag's conversations run, scores the answers with lm_eval alone, and exits 1 where the
    dtype's answers are wrong again (vLLM's stand-in started with a fault for the fp8 engine), 0 where not."""
    from kvdiag.checks.accuracy.repro import script
    from kvdiag.tasks import TASKS_DIR

    run, rec, lost = recorded(tmp_path, fault)
    text = script(rec, run)
    ns: dict = {"__name__": "reproducer"}
    exec(compile(text, "r.py", "exec"), ns)
    case = ns["CASE"]
    assert sorted(case["requests"]) == sorted(lost) and "include_path" not in case and "Reads the task" not in text
    assert str(TASKS_DIR) not in text and "import kvdiag" not in text and "from kvdiag" not in text
    (tmp_path / "r.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": str(SUPPORT / "fake_vllm")}
    p = subprocess.run([sys.executable, str(tmp_path / "r.py")], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == code, p.stdout + p.stderr
    doc = lost[0]
    target = case["requests"][doc]["target"]
    assert f"  {doc}: 1 -> 0; now 1 -> {0 if fault else 1}" in p.stdout
    assert f"target {target!r}; auto answers {target!r}" in p.stdout.replace("\x1e", " | ")


def test_a_generation_task_whose_carried_scoring_disagrees_with_the_run_reads_its_dataset(tmp_path):
    """Where the carried scoring does not give a baseline answer the value lm_eval gave it in the run, the script
    reads the task's dataset as before, and the line under its first says why."""
    from kvdiag.checks.accuracy.repro import script

    run, rec, lost = recorded(tmp_path)
    samples = tmp_path / "artifacts" / "auto.samples.json"
    values = json.loads(samples.read_text())
    values["kv_decode"]["exact_match"][lost[0]] = 0.5  # no answer scores so
    samples.write_text(json.dumps(values))
    text = script(rec, run)
    assert text.splitlines()[1].startswith("# Reads the task's dataset: the carried scoring gives document")
    ns: dict = {"__name__": "reproducer"}
    exec(compile(text, "r.py", "exec"), ns)
    assert "generation" not in ns["CASE"] and ns["CASE"]["include_path"]
