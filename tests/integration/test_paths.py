"""`kvdiag paths` on the builtin engine, as a user runs it (the paths it has as the repository's suite runs them, in
the README's CI command): every path the engine has is taken (its counter grew) and passes against the cold path;
paths it lacks are unsupported in seconds, with the reason; each of the engine's
path faults fails exactly its own path, naming the first diverging token; bad input exits 2 before any worker; and
the run compares with another (`kvdiag compare`)."""

import json
import subprocess
import sys

import pytest

HAS = ("prefix-hit", "prefix-partial", "prefix-reset", "preemption", "chunked-prefill")
LACKS = ("cudagraph-piecewise", "spec-ngram", "offload")
FAULTED = ("prefix-hit", "preemption", "chunked-prefill")  # the paths each path fault runs


def kvdiag(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def clean(shipped_suite, tmp_path_factory):
    """The paths the engine has as the repository's suite runs them (kvdiag.toml's [paths], in the README's CI
    command: tests/conftest.py runs it once for this module and test_ci_run.py), and the paths it lacks, run here:
    {"has": {path: case}, "lacks": {path: case}, "has_dir", "lacks_dir": their run directories}."""
    out = tmp_path_factory.mktemp("paths") / "lacks"
    r = kvdiag("paths", "-d", "auto", "--device", "cpu", "-f", "json", "-o", str(out),
               *[a for p in LACKS for a in ("-p", p)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert shipped_suite["a"].returncode == 0, shipped_suite["a"].stderr[-2000:]
    suite = [json.loads(x) for x in (shipped_suite["A"] / "results.jsonl").read_text().splitlines()]
    return {"has": by_path({"cases": [c for c in suite if c["check"] == "paths"]}),
            "lacks": by_path(json.loads(r.stdout)), "has_dir": shipped_suite["A"], "lacks_dir": out}


def by_path(run: dict) -> dict:
    return {c["metrics"].get("path") or c["params"]["path"]: c for c in run["cases"]}


def test_every_path_the_engine_has_is_taken_and_matches_the_cold_path(clean):
    has, lacks = clean["has"], clean["lacks"]
    assert set(has) == {"cold", *HAS}  # the suite's [paths]
    for name in HAS:
        c = has[name]
        m = c["metrics"]
        assert c["status"] == "pass", (name, c["findings"])
        assert m["diverged_requests"] == 0 and m["max_dlogprob"] <= m["tolerance"]
        assert m["floor"]["runs"] >= 3 and m["tolerance"] >= 1e-4  # chunked-prefill: its own engine's too
        if name == "prefix-reset":
            assert m["counted"] == 0  # cold again after reset_prefix_cache()
        else:
            assert m["counted"] > 0, name  # the path was taken: hits, preemptions, chunks
    for name in LACKS:
        c = lacks[name]
        assert c["status"] == "unsupported" and c["duration_s"] < 10
        assert "builtin engine" in c["findings"][0]["message"]


def test_sliding_window_is_unsupported_in_seconds_without_a_window():
    """The tiny model has no sliding layer; the builtin engine never decodes past a window (zoo:gemma3 is refused
    as a model it cannot run, exit 2)."""
    r = kvdiag("paths", "-d", "auto", "--device", "cpu", "-f", "json", "-p", "sliding-window", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    (c,) = json.loads(r.stdout)["cases"]
    assert c["status"] == "unsupported" and c["duration_s"] < 10
    assert "no sliding-window layer in tiny-llama (zoo:gemma3" in c["findings"][0]["message"]


def test_report_has_the_path_by_dtype_grid(clean):
    has, lacks = [(clean[k] / "report.md").read_text() for k in ("has_dir", "lacks_dir")]
    assert "## paths: path x kv dtype" in has and "| prefix-hit | pass |" in has
    assert "| offload | unsupported |" in lacks
    assert "paths: path x kv dtype" in (clean["has_dir"] / "report.html").read_text()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """``faulty(fault)`` -> (the finished command, its run dir): three paths with one path fault, run once per fault
    (the compare test reads chunk_context_dropped's run too). ``--isolate run``, one worker for the cases: a path fault
    lives in each case's engine object, not in the process; the clean run keeps the default isolation. The prompts
    and tokens are those `kvdiag selftest` holds each path fault to (the check's ``selftest`` sizes)."""
    from kvdiag.checks.paths import Paths

    sizes = Paths.selftest
    runs = {}

    def run(fault):
        if fault not in runs:
            out = tmp_path_factory.mktemp("faulty") / fault
            runs[fault] = kvdiag("paths", "-d", "auto", "--device", "cpu", "-f", "json", "-o", str(out), "--fault",
                                 fault, "--isolate", "run", "--num-prompts", str(sizes["num_prompts"]),
                                 "--max-tokens", str(sizes["max_tokens"]),
                                 *[a for p in FAULTED for a in ("-p", p)]), out
        return runs[fault]

    return run


@pytest.mark.parametrize("fault, path", [("prefix_hit_treated_fresh", "prefix-hit"),
                                         ("preempt_keeps_freed_blocks", "preemption"),
                                         ("chunk_context_dropped", "chunked-prefill")])
def test_each_path_fault_fails_its_own_path_only(fault, path, faulty):
    r, _ = faulty(fault)
    assert r.returncode == 1, r.stderr[-2000:]
    cases = by_path(json.loads(r.stdout))
    assert {n for n, c in cases.items() if c["status"] == "fail"} == {path}
    assert all(cases[n]["metrics"]["counted"] > 0 for n in FAULTED), cases  # each path taken at these sizes
    f = next(x for x in cases[path]["findings"] if x["kind"] == "divergence")
    assert "first differs at generated position" in f["message"] and cases[path]["metrics"]["first_difference"]


def test_compare_with_a_faulty_run_regresses(clean, faulty):
    old = clean["has_dir"]
    _, new = faulty("chunk_context_dropped")
    r = kvdiag("compare", str(old), str(new), "-f", "json")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "paths: diverging prompts" in r.stdout


def test_prefix_evicted_at_every_prompt_length_matches_the_cold_path_and_its_fault_fails_it_only(tmp_path):
    """prefix-evicted with --lengths (a prompt of every length mod the block size): the clean engine evicts cached
    blocks, hits the ones left and matches the cold path; a block evicted with its hash kept fails it, and not
    prefix-hit (whose pool never fills)."""
    r = kvdiag("paths", "-d", "auto", "--device", "cpu", "-f", "json", "-o", str(tmp_path / "clean"), "--lengths",
               "--num-prompts", "4", "--max-tokens", "12", "-p", "prefix-evicted")
    assert r.returncode == 0, r.stderr[-2000:]
    c = by_path(json.loads(r.stdout))["prefix-evicted"]
    m = c["metrics"]
    assert c["status"] == "pass" and m["diverged_requests"] == 0, c["findings"]
    assert m["counted"] > 0 and m["hit_tokens_after"] > 0  # blocks were evicted, and those left hit
    block = m["block_size"]
    assert sorted(n % block for n in m["prompt_tokens"]) == list(range(block))  # every residue, once
    r = kvdiag("paths", "-d", "auto", "--device", "cpu", "-f", "json", "-o", str(tmp_path / "faulty"), "--fault",
               "evicted_block_keeps_hash", "--isolate", "run", "--num-prompts", "4", "--max-tokens", "12",
               "-p", "prefix-evicted", "-p", "prefix-hit")
    assert r.returncode == 1, r.stderr[-2000:]
    cases = by_path(json.loads(r.stdout))
    assert {n for n, x in cases.items() if x["status"] == "fail"} == {"prefix-evicted"}
    assert "first differs at generated position" in cases["prefix-evicted"]["findings"][0]["message"]


def test_long_context_grows_the_prompts_and_a_model_too_short_is_unsupported():
    """--long-context N: the prompts hold N tokens and more (prompt i, N + i) and a prefix hit reads their full
    blocks; an N past the model's length is unsupported with the length it runs at, before any engine starts."""
    r = kvdiag("paths", "-d", "auto", "--device", "cpu", "-f", "json", "--long-context", "160", "--num-prompts", "2",
               "--max-tokens", "8", "-p", "prefix-hit", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    (c,) = json.loads(r.stdout)["cases"]
    m = c["metrics"]
    assert c["status"] == "pass" and m["prompt_tokens"] == [160, 161], c["findings"]
    assert m["counted"] >= (160 - 1) // m["block_size"] * m["block_size"]  # a long prompt's every full block hit
    r = kvdiag("paths", "-d", "auto", "--device", "cpu", "-f", "json", "--long-context", "100000", "-p", "prefix-hit",
               "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    (c,) = json.loads(r.stdout)["cases"]
    assert c["status"] == "unsupported" and "runs at most 2048" in c["findings"][0]["message"]


@pytest.mark.parametrize("args, words", [(["-p", "prefix-hot"], "prefix-hot"),
                                         (["--floor-factor", "0.5"], "--floor-factor"),
                                         (["--num-prompts", "1"], "--num-prompts"),
                                         (["--long-context", "-1"], "--long-context")])
def test_bad_input_exits_2_with_one_line(args, words):
    r = kvdiag("paths", *args)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
