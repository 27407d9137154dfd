"""What the commands print says what it means: progress numbers, the wake-cycle table, selftest's last line, help
text and metavars, shell completion, comparing unrelated runs."""

import io
import json
import os
import subprocess
import sys

from rich.console import Console

from kvdiag.checks.wake_cycle.view import render as wake_cycle
from kvdiag.results import CaseResult, RunRecord, write_run_json
from kvdiag.run.progress import Progress
from kvdiag.run.runner import Case

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
DTYPES = ["auto", "bfloat16", "float16", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"]


def kvdiag(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_a_case_keeps_its_number_from_start_to_done(capsys):
    a, b = (Case("memleak", "builtin", "m", d, "x:y") for d in ("auto", "fp8"))
    p = Progress(3)
    p.start(a)
    p.start(b)
    p.finish(b.result("pass"))
    p.finish(a.result("fail"))
    p.finish(CaseResult("memleak/builtin/m/int8", "memleak", "builtin", "m", "int8", "error"))  # never started
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("[1/3] memleak/builtin/m/auto ...")
    assert lines[1].startswith("[2/3] memleak/builtin/m/fp8 ...")
    assert lines[2].startswith("[2/3] memleak/builtin/m/fp8: pass") and lines[2].endswith("1/3 done)")
    assert lines[3].startswith("[1/3] memleak/builtin/m/auto: fail") and lines[3].endswith("2/3 done)")
    assert lines[4].startswith("[3/3] memleak/builtin/m/int8: error") and lines[4].endswith("3/3 done)")


def wake_run() -> RunRecord:
    cases = []
    for d in DTYPES:
        bad = d == "fp8"
        cycles = [{"cycle": n, "level": 1, "staged": False, "freed_bytes": 8 << 20, "restored": True,
                   "identical": not (bad and n >= 3), "max_dlogprob": 0.5 if bad and n >= 3 else 0.0,
                   "nonfinite_logprobs": 0, "kv_nonfinite": 0, "kv_bad_scales": 0,
                   "problems": ["divergence"] if bad and n >= 3 else []} for n in range(1, 6)]
        rec = CaseResult(f"wake-cycle/builtin/m/{d}/L1", "wake-cycle", "builtin", "m", d, "fail" if bad else "pass",
                         metrics={"level": 1, "staged": False, "expected_bytes": 8 << 20, "cycles": cycles})
        cases.append(rec)
    skipped = CaseResult("wake-cycle/builtin/m/auto/L2", "wake-cycle", "builtin", "m", "auto", "skipped")
    skipped.add("info", "unsupported", "sleep level 2 is not supported here")
    return RunRecord("kvdiag wake-cycle", "now", cases + [skipped], {})


def test_wake_cycle_table_is_one_row_per_case_and_no_empty_column():
    buf = io.StringIO()
    wake_cycle(wake_run(), Console(file=buf, width=200, no_color=True))
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in buf.getvalue().splitlines() if line.startswith("│")]
    assert len(rows) == len(DTYPES) + 1  # 8 cases, 40 cycles
    assert all(any(row[i] not in ("", "-") for row in rows) for i in range(len(rows[0])))  # every column says something
    fp8 = next(row for row in rows if row[0] == "fp8")
    assert fp8[2] == "5" and fp8[5] == "no (cycle 3, 4, 5)" and "c3: divergence" in fp8[-1]
    assert "sleep level 2 is not supported here" in rows[-1][-1]


def test_a_cpu_memleak_table_at_80_columns_cuts_no_number_and_has_no_cuda_column(tmp_path):
    """At 80 columns no number may be cut (`p…`, `1…`): the columns this run never measured (a CPU run's four
    CUDA ones) are left out and the dtype heads its snapshots, so the numbers stay whole."""
    from kvdiag.measure.memory import MiB, Snapshot

    cases = []
    for d in DTYPES:
        snaps = [Snapshot("baseline", 0, int(612.37 * MiB), 0, 3, int(0.12 * MiB), {})]
        for n in (1, 2, 3):  # as a CPU run records them: no CUDA, driver or NVML reading; frozen only after shutdown
            snaps += [Snapshot("after-workload", n, int((1834.56 + n) * MiB), None, 41, int(64.5 * MiB), {}),
                      Snapshot("after-shutdown", n, int((1220.11 + n) * MiB), 0, 3, int(0.12 * MiB), {})]
        case = Case("memleak", "builtin", "/m/tiny-llama", d, "x:y").result(
            "pass", metrics={"snapshots": [s.row() for s in snaps], "threshold_mib": 64.0})
        cases.append(case)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(c.to_json()) + "\n" for c in cases))
    write_run_json(tmp_path, RunRecord("kvdiag memleak", "now", cases, {}, exit_code=0))
    r = kvdiag("report", str(tmp_path), "--format", "table", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "…" not in r.stdout and all(len(line) <= 80 for line in lines), r.stdout
    assert not any(word in r.stdout for word in ("CUDA", "driver", "NVML")), r.stdout
    rows = [line.split() for line in lines if line[:3] in (" 0 ", " 1 ", " 2 ", " 3 ")]
    assert len(rows) == 7 * len(DTYPES), r.stdout
    for row in rows:  # cycle, stage, tensors, tensor MiB, RSS MiB, frozen (`-` where it was not read)
        assert len(row) == 6 and row[-1] == ("-" if row[1] == "after-workload" else "0"), row
    assert [row[4] for row in rows[:3]] == ["612.4", "1836", "1221"] and rows[1][2:4] == ["41", "64.5"]
    heads = [line.split() for line in lines if line.split()[:1] and line.split()[0] in DTYPES]
    assert heads == [[d, "pass"] for d in DTYPES]


def test_selftest_verdict_says_what_the_failed_case_means():
    from kvdiag.report.table import verdict_line

    cases = [CaseResult("poison/builtin/m/auto", "poison", "builtin", "m", "auto", "pass"),
             CaseResult("poison/builtin/m/auto/unzeroed", "poison", "builtin", "m", "auto", "fail")]
    run = RunRecord("kvdiag selftest -c poison", "now", cases, {}, run_dir="R", exit_code=0,
                    summary={"pass": 1, "fail": 1},
                    analysis={"selftest": {"ok": True, "faults": [{"fault": "unzeroed_page_reads",
                                                                   "caught_by_intended": True}],
                                           "clean": {"poison": {"mark": "pass"}}}})
    line = verdict_line(run)
    assert line.startswith("[green]OK[/]: 1 of 1 fault(s) caught by their intended check, the clean engine passed")
    assert "fail" not in line
    run.summary = {"pass": 2}
    run.analysis = {}
    assert verdict_line(run) == "[green]OK[/]: 2 pass — results in"  # the run directory follows, never broken


COMMANDS = ("accuracy", "dtypes", "memleak", "wake-cycle", "poison", "bench", "ci", "report", "compare", "selftest")


def test_help_reads_as_a_person_writes_the_options():
    for command in COMMANDS:
        text = kvdiag(command, "--help", env={"COLUMNS": "120"}).stdout
        assert "<list[" not in text and " range>" not in text and "<str>" not in text, (command, text)
    text = kvdiag("accuracy", "--help", env={"COLUMNS": "120"}).stdout
    for usage in ("--kv-dtype DTYPE", "--engine-arg KEY=VALUE", "--timeout SECONDS", "--max-drop X", "--jobs N"):
        assert usage in text, usage


def test_isolate_help_of_check_commands_is_about_them():
    for command in ("poison", "wake-cycle"):
        text = " ".join(kvdiag(command, "--help", env={"COLUMNS": "200"}).stdout.split())
        isolate = text[text.index("--isolate"):text.index("--isolate") + 400]
        assert "accuracy" not in isolate and "one worker process runs the dtypes one after another" in isolate


def test_shell_completion_completes_commands_and_options():
    assert "--install-completion" in kvdiag("--help").stdout
    r = kvdiag(env={"_KVDIAG_COMPLETE": "complete_bash", "COMP_WORDS": "kvdiag acc", "COMP_CWORD": "1"})
    assert r.returncode == 0 and r.stdout.split() == ["accuracy"]
    r = kvdiag(env={"_KVDIAG_COMPLETE": "complete_bash", "COMP_WORDS": "kvdiag poison --va", "COMP_CWORD": "2"})
    assert r.stdout.split() == ["--value"]


def test_comparing_unrelated_runs_is_bad_input(tmp_path):
    from accuracy_runs import recall_run

    accuracy_run = tmp_path / "accuracy"
    accuracy_run.mkdir()
    recall_run(accuracy_run)
    memleak_run = tmp_path / "memleak"
    memleak_run.mkdir()
    case = Case("memleak", "builtin", "/m/tiny-llama", "auto", "x:y").result("pass")
    (memleak_run / "results.jsonl").write_text(json.dumps(case.to_json()) + "\n")
    write_run_json(memleak_run, RunRecord("kvdiag memleak", "now", [case], {}, exit_code=0))
    r = kvdiag("compare", str(memleak_run), str(accuracy_run))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "share no case" in r.stderr, r.stderr
    assert "'kvdiag memleak' on tiny-llama vs 'kvdiag accuracy' on tiny-llama" in r.stderr
    r = kvdiag("compare", str(accuracy_run), str(accuracy_run))  # the same run: related, nothing regressed
    assert r.returncode == 0, r.stderr


def test_an_option_of_one_value_given_twice_is_bad_input_not_the_last_one_silently(tmp_path):
    """`kvdiag accuracy -m A -m B` would run only B (click keeps the last value), silently losing A's results:
    one line instead, exit 2, before anything runs; a repeatable option still repeats."""
    r = kvdiag("accuracy", "-m", "zoo:qwen3", "--model=zoo:gemma3", "-d", "auto", "-o", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--model/-m given 2 times" in r.stderr and "kvdiag ci" in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()
    r = kvdiag("accuracy", "-d", "auto", "-d", "fp8", "--timeout", "1", "--timeout", "2")
    assert r.returncode == 2 and "--timeout given 2 times" in r.stderr, r.stderr


def test_a_paths_case_judged_after_its_reference_is_said_as_ran_not_pass_until_judged(tmp_path):
    """A path held to its reference case is judged once the run ends: its progress line must not promise a pass the
    verdict may take back (the GPU self-test, killed mid-run, left such lines saying pass under a fault)."""
    p = kvdiag("paths", "-d", "auto", "-p", "chunked-prefill", "--device", "cpu", "-o", str(tmp_path / "r"),
               env={"CI": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    done = [x for x in p.stderr.splitlines() if "done)" in x]
    assert any("/chunked-prefill: ran (judged at the end)" in x for x in done), done
    assert any("/cold: pass" in x for x in done), done
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    status = {c["params"]["path"]: (c["status"], "judged_later" in c["metrics"]) for c in run["cases"]}
    assert status == {"cold": ("pass", False), "chunked-prefill": ("pass", False)}, status
