"""lm_eval's options of `kvdiag accuracy` reach lm_eval: the chat template (against transformers' own rendering),
the system instruction, --gen-kwargs, --batch-size, --metadata; bad values exit 2 with one line before any worker."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.checks.accuracy.harness.lm_eval_options import key_values
from kvdiag.cli.app import options_of
from kvdiag.cli.lm_eval_spellings import translate
from kvdiag.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
FIRST_DOC = json.loads((ROOT / "kvdiag/tasks/data/kv_recall.jsonl").read_text().splitlines()[0])

# a generating task over kv_recall's documents, and one whose documents come from --metadata
GEN_TASK = f"""task: kv_recall_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {ROOT / "kvdiag/tasks/data/kv_recall.jsonl"}
custom_dataset: !function utils.load
test_split: test
output_type: generate_until
doc_to_text: context
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
META_TASK = """task: meta_docs
dataset_path: json
custom_dataset: !function utils.from_metadata
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
UTILS = """import json
import datasets


def load(data_files=None, **_):
    rows = [json.loads(x) for x in open(data_files["test"])]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def from_metadata(n_docs=1, pretrained=None, **_):
    rows = [{"context": f"{pretrained.rstrip('/').split('/')[-1]} k{i}=", "choices": ["1", "2"], "answer": 0}
            for i in range(int(n_docs))]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
"""


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tasks")
    (d / "kv_recall_gen.yaml").write_text(GEN_TASK)
    (d / "meta_docs.yaml").write_text(META_TASK)
    (d / "utils.py").write_text(UTILS)
    return d


def kvdiag(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def settings(run_dir: Path) -> dict:
    rec = json.loads((run_dir / "results.jsonl").read_text().splitlines()[0])
    return rec["metrics"]["lm_eval"] | {"scores": rec["metrics"]["scores"]}


def test_the_options_are_in_help():
    r = kvdiag("accuracy", "--help")
    for flag in ("--apply-chat-template", "--batch-size", "--gen-kwargs", "--system-instruction",
                 "--fewshot-as-multiturn", "--metadata", "--num-fewshot", "--limit", "--seed"):
        assert flag in r.stdout, flag


@pytest.mark.slow
def test_chat_template_and_system_instruction_reach_the_prompt_as_transformers_renders_them(chat_model, tmp_path):
    from transformers import AutoTokenizer

    r = kvdiag("accuracy", "-m", chat_model, "-d", "auto", "-t", "kv_recall", "--limit", 3, "--apply-chat-template",
               "--system-instruction", "Be exact.", "-o", tmp_path / "chat", "-q")
    assert r.returncode == 0, r.stderr
    got = settings(tmp_path / "chat")
    want = AutoTokenizer.from_pretrained(chat_model).apply_chat_template(
        [{"role": "system", "content": "Be exact."}, {"role": "user", "content": FIRST_DOC["context"]}],
        tokenize=False, add_generation_prompt=True)
    assert got["examples"]["kv_recall"]["prompt"] == want
    assert got["fewshot_as_multiturn"] is True and got["chat_template"] == "default"
    r = kvdiag("accuracy", "-m", chat_model, "-d", "auto", "-t", "kv_recall", "--limit", 3, "-o", tmp_path / "plain",
               "-q")
    assert r.returncode == 0, r.stderr
    plain = settings(tmp_path / "plain")
    assert plain["examples"]["kv_recall"]["prompt"] == FIRST_DOC["context"]
    assert plain["fewshot_as_multiturn"] is False
    # the template changes what the model scores: the log-likelihood of the same answer differs
    assert plain["examples"]["kv_recall"]["response"] != got["examples"]["kv_recall"]["response"]


@pytest.mark.slow
def test_gen_kwargs_update_the_tasks_generation(tasks_dir, tmp_path):
    from kvdiag.assets import TINY_MODEL
    from kvdiag.engines.builtin.tokenizer import plain

    tok = plain(Path(TINY_MODEL))
    lengths = {}
    for name, extra in (("default", []), ("short", ["--gen-kwargs", "max_gen_toks=2,until=[]"])):
        r = kvdiag("accuracy", "-d", "auto", "-t", "kv_recall_gen", "--include-path", tasks_dir, "--limit", 2,
                   *extra, "-o", tmp_path / name, "-q")
        assert r.returncode == 0, r.stderr
        got = settings(tmp_path / name)
        lengths[name] = len(tok.encode(got["examples"]["kv_recall_gen"]["response"], add_special_tokens=False))
        assert "exact_match" in got["scores"]["kv_recall_gen"]
    assert got["gen_kwargs"]["max_gen_toks"] == 2
    assert lengths["short"] <= 2 < lengths["default"]


@pytest.mark.slow
def test_batch_size_sets_the_requests_per_engine_call(tmp_path):
    calls = {}
    for b in ("auto", "2"):
        r = kvdiag("accuracy", "-d", "auto", "-t", "kv_recall", "--limit", 5, "--batch-size", b, "-o", tmp_path / b,
                   "-q")
        assert r.returncode == 0, r.stderr
        calls[b] = settings(tmp_path / b)["engine_calls"]
    # 5 documents x 4 choices; the 4 requests of one context stay together: one call, or one call per document
    assert calls == {"auto": 1, "2": 5}


@pytest.mark.slow
def test_metadata_reaches_the_task_with_the_model(tasks_dir, tmp_path):
    r = kvdiag("accuracy", "-d", "auto", "-t", "meta_docs", "--include-path", tasks_dir, "--metadata", "n_docs=3",
               "-o", tmp_path / "m", "-q")
    assert r.returncode == 0, r.stderr
    got = settings(tmp_path / "m")
    assert got["scores"]["meta_docs"]["acc"]["n"] == 3
    assert got["examples"]["meta_docs"]["prompt"] == "tiny-llama k0="


def test_lm_evals_metadata_hint_is_dropped_for_kvdiags_own_tasks_only(tasks_dir, caplog):
    """lm_eval warns "Custom kwargs can be passed to `--metadata`" at each load of a task with a custom_dataset:
    every kvdiag task, which takes none. A user's task keeps the hint: its function may want --metadata."""
    import logging

    from kvdiag.tasks import task_manager

    with caplog.at_level(logging.WARNING):
        task_manager([tasks_dir], include_defaults=False, metadata={"pretrained": "m"}).load(
            ["kv_recall", "kv_recall_long", "meta_docs"])
    hints = [r.getMessage().split(":")[0] for r in caplog.records if "Custom kwargs" in r.getMessage()]
    assert hints == ["meta_docs"], [r.getMessage() for r in caplog.records]


@pytest.mark.slow
def test_a_run_of_kvdiags_tasks_prints_no_metadata_hint(tmp_path):
    # tasks loaded by the one worker; by the fork server (isolate case): the README's main job, test_wheel.py
    for isolate in ("run",):
        r = kvdiag("accuracy", "-d", "auto", "-t", "kv_recall", "--limit", 2, "--isolate", isolate, "-o",
                   tmp_path / isolate)
        assert r.returncode == 0, r.stderr
        logs = "".join(f.read_text() for f in (tmp_path / isolate / "logs").iterdir())
        assert "accuracy/builtin" in r.stderr and logs and "--metadata" not in r.stderr + logs, r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--batch-size", "0"], "--batch-size '0'"),
    (["--batch-size", "many"], "--batch-size 'many'"),
    (["--gen-kwargs", "max_gen_toks"], "--gen-kwargs 'max_gen_toks' is not key=value"),
    (["--metadata", "{bad"], "--metadata: not a JSON object"),
    (["--fewshot-as-multiturn"], "needs --apply-chat-template"),
    (["--apply-chat-template"], "has no chat template"),
    (["--limit", "-5"], "--limit -5"),
])
def test_bad_values_exit_2_with_one_line_before_any_worker(args, needle, tmp_path):
    r = kvdiag("accuracy", "-d", "auto", *args, "-o", tmp_path / "x", timeout=60)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x" / "results.jsonl").exists()


def test_a_named_template_must_be_one_the_tokenizer_has(chat_model):
    r = kvdiag("accuracy", "-m", chat_model, "-d", "auto", "--apply-chat-template", "tool_use", timeout=60)
    assert r.returncode == 2 and "templates are default" in r.stderr, r.stderr


def test_key_values_take_pairs_with_brackets_and_json_objects():
    assert key_values("--gen-kwargs", 'until=["\\n", ","],max_gen_toks=8,temperature=0.5') == {
        "until": ["\n", ","], "max_gen_toks": 8, "temperature": 0.5}
    assert key_values("--metadata", '{"max_seq_lengths": [4096, 8192]}') == {"max_seq_lengths": [4096, 8192]}
    assert key_values("--metadata", "tokenizer=gpt2") == {"tokenizer": "gpt2"}
    with pytest.raises(UserError):
        key_values("--metadata", "[1, 2]")


def test_apply_chat_template_takes_an_optional_name():
    for flag in ("--apply-chat-template", "--apply_chat_template"):
        assert translate(["accuracy", flag], options_of) == ["accuracy", "--apply-chat-template=default"]
        assert translate(["accuracy", flag, "--limit", "3"], options_of)[1] == "--apply-chat-template=default"
        assert translate(["accuracy", flag, "chatml"], options_of) == ["accuracy", "--apply-chat-template", "chatml"]


@pytest.mark.slow
def test_progress_shows_documents_and_their_rate_and_the_case_records_them(tmp_path):
    import os

    env = {**os.environ, "KVDIAG_PROGRESS_S": "0"}  # a line after every engine call
    r = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-d", "auto", "-t", "kv_recall,kv_recall_long",
                        "--limit", "7", "--batch-size", "8", "-o", str(tmp_path / "p")], capture_output=True, text=True,
                       cwd=ROOT, timeout=300, env={k: str(v) for k, v in env.items()})
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "documents, " in x and "doc/s" in x]
    assert any("/14 documents" in x for x in lines) and any(" 14/14 documents" in x for x in lines), r.stderr
    assert "14 documents at " in r.stderr  # the case's end line
    rec = json.loads((tmp_path / "p" / "results.jsonl").read_text().splitlines()[0])["metrics"]
    assert rec["documents"] == 14 and rec["documents_per_s"] > 0
    assert rec["peak_mib"]["gpu"] is None and rec["peak_mib"]["rss"] > 100  # a worker with torch imported


@pytest.mark.slow
def test_engine_args_naming_spec_fields_reach_the_builtin_engine(tmp_path):
    r = kvdiag("accuracy", "-d", "auto", "-t", "kv_recall", "--limit", 2, "-a", "kv_cache_memory=1000", "-o",
               tmp_path / "k", "-q")
    assert r.returncode == 1
    rec = json.loads((tmp_path / "k" / "results.jsonl").read_text().splitlines()[0])
    assert "kv_cache_memory 1000 B holds no block" in rec["findings"][0]["message"]


def test_a_long_prompt_is_kept_by_its_ends():
    from kvdiag.checks.accuracy.harness.lm_eval_results import EXAMPLE_CHARS, _clip

    text = "".join(chr(97 + i % 26) for i in range(50_000))
    got = _clip(text)
    assert got.startswith(text[:EXAMPLE_CHARS // 2]) and got.endswith(text[-EXAMPLE_CHARS // 2:])
    assert "[46,000 characters]" in got and len(got) < EXAMPLE_CHARS + 40
    assert _clip("short") == "short"
