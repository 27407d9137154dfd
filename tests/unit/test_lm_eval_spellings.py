"""lm_eval's spellings carry over: each alias builds the same cases as kvdiag's own spelling (no engine runs: the
cases are caught where the command hands them to execute), and lm_eval options whose meaning differs exit 2 with one
line naming kvdiag's spelling."""

import shutil
from pathlib import Path

import pytest

from kvdiag.cli.app import main


@pytest.fixture
def caught(monkeypatch):
    """The cases and run directory each command hands to orchestrate.record (through kvdiag.run_check, or
    orchestrate.execute), which runs nothing."""
    from types import SimpleNamespace

    import kvdiag.run.orchestrate

    calls = []

    def record(cases, run_dir, **kw):
        calls.append({"cases": cases, "run_dir": Path(run_dir)})
        return SimpleNamespace(exit_code=0)

    monkeypatch.setattr(kvdiag.run.orchestrate, "record", record)
    return calls


def built(caught, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    assert e.value.code == 0
    return caught.pop()


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    import shutil

    d = tmp_path_factory.mktemp("tasks")
    src = Path(__file__).resolve().parents[2] / "kvdiag/tasks"
    (d / "kv_recall_copy.yaml").write_text((src / "kv_recall.yaml").read_text().replace("task: kv_recall",
                                                                                         "task: kv_recall_copy"))
    for helper in ("kv_utils.py", "recall.py"):  # the task's own functions and data: kvdiag loads it up front
        shutil.copy(src / helper, d / helper)
    shutil.copytree(src / "data", d / "data")
    return d


PAIRS = [  # (lm_eval's words, kvdiag's words)
    (["--model_args", "max_num_seqs=4"], ["-a", "max_num_seqs=4"]),
    (["--model_args", "max_num_seqs=4", "block_size=32"], ["-a", "max_num_seqs=4,block_size=32"]),
    (["--model_args=max_num_seqs=4,block_size=32"], ["--engine-arg", "max_num_seqs=4", "-a", "block_size=32"]),
    (["--model-args", "max_num_seqs=4"], ["-a", "max_num_seqs=4"]),  # lm_eval's name in kvdiag's hyphens
    (["--num_fewshot", "2"], ["--num-fewshot", "2"]),
    (["--num_fewshot=2"], ["--num-fewshot", "2"]),
    (["--batch_size", "8"], ["--batch-size", "8"]),
    (["--gen_kwargs", "max_gen_toks=5", "temperature=0"], ["--gen-kwargs", "max_gen_toks=5,temperature=0"]),
    (["--system_instruction", "Be exact."], ["--system-instruction", "Be exact."]),
    (["--log_samples"], []),  # kvdiag always keeps every document's result
]


@pytest.mark.parametrize("lm_eval,own", PAIRS, ids=[" ".join(p[0]) for p in PAIRS])
def test_an_lm_eval_spelling_builds_the_same_cases_as_kvdiags(caught, tmp_path, lm_eval, own):
    common = ["accuracy", "-d", "auto", "-d", "fp8", "-t", "kv_recall", "-q"]
    mine = built(caught, *common, *own, "-o", tmp_path / "own")
    theirs = built(caught, *common, *lm_eval, "-o", tmp_path / "lm_eval")
    assert [c.params for c in theirs["cases"]] == [c.params for c in mine["cases"]]
    assert [c.id for c in theirs["cases"]] == [c.id for c in mine["cases"]]
    if lm_eval != ["--log_samples"]:  # the option did reach the cases: they differ from the defaults'
        default = built(caught, *common, "-o", tmp_path / "default")
        assert [c.params for c in default["cases"]] != [c.params for c in mine["cases"]]


def test_chat_template_spellings(caught, tmp_path, chat_model):
    common = ["accuracy", "-m", chat_model, "-d", "auto", "-t", "kv_recall"]
    for lm_eval, own in ((["--apply_chat_template"], ["--apply-chat-template"]),
                         (["--apply_chat_template", "--fewshot_as_multiturn", "false"],
                          ["--apply-chat-template", "--no-fewshot-as-multiturn"]),
                         (["--apply_chat_template=default", "--fewshot_as_multiturn"],
                          ["--apply-chat-template", "default", "--fewshot-as-multiturn"])):
        theirs = built(caught, *common, *lm_eval, "-o", tmp_path / "a")["cases"][0].params
        assert theirs == built(caught, *common, *own, "-o", tmp_path / "b")["cases"][0].params
        assert theirs["apply_chat_template"] == "default"
        assert theirs["fewshot_as_multiturn"] is ("false" not in lm_eval)


def test_include_path_spelling(caught, tmp_path, tasks_dir):
    common = ["accuracy", "-d", "auto", "-t", "kv_recall_copy"]
    theirs = built(caught, *common, "--include_path", tasks_dir, "-o", tmp_path / "a")["cases"][0].params
    assert theirs == built(caught, *common, "--include-path", tasks_dir, "-o", tmp_path / "b")["cases"][0].params
    assert theirs["tasks"] == ["kv_recall_copy"] and theirs["include_paths"] == [str(tasks_dir)]


def test_output_path_is_the_run_directory_of_accuracy_and_ci(caught, tmp_path):
    assert built(caught, "accuracy", "-d", "auto", "--output_path", tmp_path / "acc")["run_dir"] == tmp_path / "acc"
    cfg = tmp_path / "kvdiag.toml"
    cfg.write_text('kv_dtypes = ["auto"]\n[poison]\n')
    assert built(caught, "ci", "-c", cfg, "--output_path", tmp_path / "ci")["run_dir"] == tmp_path / "ci"


@pytest.mark.parametrize("args,needle", [
    (["--model", "vllm"], "--engine"),
    (["--model", "hf"], "--engine"),
    (["--model_args", "pretrained=org/name,dtype=bfloat16"], "-m/--model org/name"),
    (["--output_path", "results.json"], "-o/--output-dir DIR"),
    (["--batch_size", "auto:4"], "--batch-size"),
    (["--use_cache", "cache.db"], "leave it out"),
    (["--model-args", "pretrained=org/name"], "-m/--model org/name"),
    (["--max_batch_size", "64"], "--batch-size N"),
])
def test_an_lm_eval_option_meaning_something_else_exits_2_with_kvdiags_spelling(caught, capsys, tmp_path, args,
                                                                                needle):
    with pytest.raises(SystemExit) as e:
        main(["accuracy", "-d", "auto", *args, "-o", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not caught
    assert err.startswith("kvdiag: error: ") and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("args,needle", [(["--num_fewshot", "2"], "num_fewshot = ... in the [accuracy] table"),
                                         (["--model_args", "a=1"], "engine_args = {key = value}")])
def test_ci_names_the_config_key_of_an_lm_eval_option(caught, capsys, args, needle):
    with pytest.raises(SystemExit) as e:
        main(["ci", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not caught and err.count("\n") == 1 and needle in err, err


def test_a_folder_named_like_a_backend_is_a_model(caught, tmp_path, monkeypatch):
    from kvdiag.assets import TINY_MODEL

    shutil.copytree(TINY_MODEL, tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert built(caught, "accuracy", "-m", "hf", "-d", "auto", "-o", tmp_path / "run")["cases"][0].model == str(
        tmp_path / "hf")


def test_backend_names_are_lm_evals():
    from lm_eval.models import MODEL_MAPPING

    from kvdiag.checks.accuracy.harness.lm_eval_options import backend_names

    assert backend_names() == set(MODEL_MAPPING)
