"""A failing case's reproducer (kvdiag.proof): the script kvdiag writes runs on its own, in a fresh process, with
only the engine importable, and exits 1 exactly when the path's output breaks the rule kvdiag's verdict applies;
kvdiag runs it after the run and records whether it reproduced, with the rate where it does not at once. The engine
here is a stand-in for vLLM (tests/support/fake_vllm) whose faults are known; real vLLM's proofs are in
tests/integration/test_vllm_proof.py and tests/gpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.case import Case
from kvdiag.results import RunRecord

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_vllm"
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def replay(**llm) -> dict:
    return {"engine": "vllm", "llm": {"model": "/m", **llm}, "sampling": {}, "env": {"VLLM_FAKE": "1"}}


def records(path: str, fault: str | None, own_floor_layouts: bool = True, status: str = "fail"):
    """A reference case and a path case as the paths check records them on vLLM (the path judged ``status``)."""
    reference = "cold-nographs" if path.startswith("cudagraph") else "cold"
    ref = Case("paths", "vllm", "/m", "auto", "t", params={"path": reference},
               id=f"paths/vllm/m/auto/{reference}").result("pass", metrics={
                   "path": reference, "role": "reference", "replay": replay(), "prompts": PROMPTS,
                   "completions": [], "layouts": {"all_but_one": []} if own_floor_layouts else {}})
    case = Case("paths", "vllm", "/m", "auto", "t", params={"path": path, "max_tokens": 6},
                id=f"paths/vllm/m/auto/{path}")
    rec = case.result(status, metrics={
        "path": path, "role": "path", "replay": replay(**({"fake_fault": fault} if fault else {})),
        "prompts": PROMPTS, "tolerance": 0.01, "completions": [],
        "layouts": {"all_but_one": []} if own_floor_layouts else {}})
    rec.add("error", "divergence", f"{path}: request 1 first differs at generated position 1")
    return ref, rec


def write(tmp_path, path="cudagraph-full", fault="token", **kw) -> Path:
    from kvdiag.checks.paths.repro import script

    ref, rec = records(path, fault, **kw)
    run = RunRecord("kvdiag paths", "", [ref, rec], {}, run_dir=str(tmp_path))
    text = script(rec, run)
    assert text is not None
    out = tmp_path / "repro.py"
    out.write_text(text)
    return out


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(FAKE)}  # the stand-in vLLM, and no kvdiag: the script needs none
    return subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, env=env, cwd=script.parent, timeout=120)


@pytest.mark.parametrize("fault, code", [("token", 1), ("drift", 1), ("nan", 1), ("batch", 1), (None, 0)])
def test_the_script_exits_1_exactly_when_the_path_breaks_the_rule(tmp_path, fault, code):
    """A changed decided token, a logprob moved past the tolerance, a NaN, and a change only in the batch of one
    (the all-but-one layout kvdiag compares for a path every run takes) reproduce; the same engine twice does not."""
    p = run_script(write(tmp_path, fault=fault))
    assert p.returncode == code, p.stdout + p.stderr
    assert ("REPRODUCED" if code else "NOT REPRODUCED") in p.stdout
    assert "kvdiag saw: cudagraph-full: request 1 first differs" in p.stdout


def test_a_batch_layout_kvdiag_did_not_compare_is_not_run(tmp_path):
    """A path judged on its batch of all the prompts only (offload) replays that batch only: a change in a request
    alone is nothing kvdiag compared, so it does not reproduce there."""
    p = run_script(write(tmp_path, path="offload", fault="batch", own_floor_layouts=False))
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("fault, code", [("connector", 1), (None, 0)])
def test_kv_connector_reproduces_with_its_engine_twice_the_first_storing_the_second_loading(tmp_path, fault, code):
    """kv-connector runs as kvdiag ran it: the path engine in a fresh process stores the prompts through the
    connector (its directory emptied first: a store kvdiag left, or an earlier reproduction's, is not read), then
    again in another, loading them, then removing the store. A load that reads wrong (the stand-in's ``connector``
    fault) reproduces; the same connector without it does not."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "left-behind").touch()  # an earlier store's
    ref, rec = records("kv-connector", fault, own_floor_layouts=False)
    rec.metrics["replay"]["llm"]["kv_transfer_config"] = {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    from kvdiag.checks.paths.repro import script

    (tmp_path / "r.py").write_text(script(rec, RunRecord("kvdiag paths", "", [ref, rec], {}, run_dir=str(tmp_path))))
    p = run_script(tmp_path / "r.py")
    assert p.returncode == code, p.stdout + p.stderr
    assert (f"{len(PROMPTS)} of {len(PROMPTS)} requests" if code else f"in all {len(PROMPTS)} requests") in p.stdout
    assert not store.exists()  # the second engine's run removes what the first stored


def own(path: str, fault: str | None, block_size: int = 2, **llm):
    """A prefix-cache path case as the paths check records it: judged in its own engine."""
    case = Case("paths", "vllm", "/m", "auto", "t", params={"path": path, "max_tokens": 6},
                id=f"paths/vllm/m/auto/{path}")
    rec = case.result("fail", metrics={
        "path": path, "role": "own", "replay": replay(**({"fake_fault": fault} if fault else {}), **llm),
        "prompts": PROMPTS, "tolerance": 0.01, "block_size": block_size})
    rec.add("error", "divergence", f"{path}: request 0 first differs at generated position 1")
    return rec


@pytest.mark.parametrize("path", ["prefix-hit", "prefix-partial"])
@pytest.mark.parametrize("fault, code", [("hit", 1), (None, 0)])
def test_a_prefix_path_reproduces_in_one_engine_its_cold_run_then_its_hit(tmp_path, path, fault, code):
    """A prefix-cache path runs as kvdiag ran it, in one engine: a fault that changes only what a hit reads back
    reproduces; prefix-reset, whose second run is cold again, does not see it."""
    from kvdiag.checks.paths.repro import script

    rec = own(path, fault)
    text = script(rec, RunRecord("kvdiag paths", "", [rec], {}, run_dir=str(tmp_path)))
    (tmp_path / "r.py").write_text(text)
    p = run_script(tmp_path / "r.py")
    assert p.returncode == code, p.stdout + p.stderr
    rec = own("prefix-reset", "hit")
    (tmp_path / "r.py").write_text(script(rec, RunRecord("k", "", [rec], {}, run_dir=str(tmp_path))))
    assert run_script(tmp_path / "r.py").returncode == 0


@pytest.mark.parametrize("fault, pool, code", [("evicted", 4, 1), (None, 4, 0), ("evicted", None, 0)])
def test_prefix_evicted_reproduces_in_one_engine_its_pool_then_the_evicting_prompts(tmp_path, fault, pool, code):
    """prefix-evicted runs as kvdiag ran it, in one engine started with its pool (``num_gpu_blocks_override``): the
    prompts, the prompts that evict them, the prompts again. A block that kept its hash after eviction is read back
    (the stand-in's ``evicted`` fault) and reproduces; the same fault in a pool that evicts nothing does not."""
    from kvdiag.checks.paths.repro import script

    rec = own("prefix-evicted", fault, **({"num_gpu_blocks_override": pool} if pool else {}))
    text = script(rec, RunRecord("kvdiag paths", "", [rec], {}, run_dir=str(tmp_path)))
    (tmp_path / "r.py").write_text(text)
    p = run_script(tmp_path / "r.py")
    assert p.returncode == code, p.stdout + p.stderr
    assert f"of {len(PROMPTS)} requests" in p.stdout or f"in all {len(PROMPTS)} requests" in p.stdout


def test_a_flip_where_the_references_top_two_were_tied_is_noise_as_in_kvdiags_verdict(tmp_path):
    from kvdiag.checks.paths.floor import Floor, distance, judge
    from kvdiag.engines.protocol import Completion

    script = write(tmp_path, fault=None)
    ns: dict = {"__name__": "reproducer"}
    exec(compile(script.read_text(), str(script), "exec"), ns)  # its comparison, without running an engine
    a = {"token_ids": [5, 6, 7, 8], "logprobs": [-0.1, -0.2, -0.3, -0.4], "top": [[-0.1, -2]] * 3 + [[-0.4, -0.4005]]}
    tied = {**a, "token_ids": [5, 6, 7, 9]}
    decided = {**a, "token_ids": [5, 9, 7, 8]}
    assert ns["held"]({"0": a}, {"0": tied}, 0.01) == []
    assert ns["held"]({"0": a}, {"0": decided}, 0.01) != []

    def comp(x):  # the same pair as kvdiag's own verdict reads it: the oracle the script must agree with
        return Completion([], x["token_ids"], x["logprobs"], [dict(enumerate(t)) for t in x["top"]])

    for b, fails in ((tied, False), (decided, True)):
        kinds = [s for s, _, _ in judge(distance([comp(a)], [comp(b)]), Floor(max_dlogprob=0.0025), 1e-4, 4.0)]
        assert ("error" in kinds) is fails


def test_the_script_names_every_engine_argument_kvdiag_used_and_needs_no_kvdiag(tmp_path):
    script = write(tmp_path)
    text = script.read_text()
    assert "import kvdiag" not in text and "from kvdiag" not in text
    p = run_script(script, "--run", "1")  # the path engine's outputs alone
    out = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("@@reproducer-output "))
                     .split(" ", 1)[1])
    assert set(out["path"]) == {"0", "1", "2", "3"} | {f"{i} in batches of all but one and one" for i in range(4)}
    assert out["reference"] == {}
    ns: dict = {"__name__": "reproducer"}
    exec(compile(text, str(script), "exec"), ns)
    assert ns["CASE"]["engines"]["path"]["llm"] == {"model": "/m", "fake_fault": "token"}
    assert ns["CASE"]["engines"]["path"]["env"] == {"VLLM_FAKE": "1"}


def window_case(fault: str | None, finding: str = "sliding-window: request (0, 5) first differs at position 5"):
    """A sliding-window case as the paths check records it on vLLM: judged in its engine against prefills at the cuts
    past the window of its decode (the stand-in's tokens each from all before it: a prefill agrees with a decode)."""
    case = Case("paths", "vllm", "/m", "auto", "t", params={"path": "sliding-window", "max_tokens": 6},
                id="paths/vllm/m/auto/sliding-window")
    rec = case.result("fail", metrics={
        "path": "sliding-window", "role": "own", "replay": replay(fake_chain=True, **({"fake_fault": fault} if fault
                                                                                     else {})),
        "prompts": PROMPTS[:3], "generated": 9, "cuts": [[0, 5], [1, 6], [2, 8], [1, 2]], "tolerance": 0.01,
        "window": len(PROMPTS[0]) + 2, "inside_cuts": [],
        "the batch against each prompt alone": {"tolerance": 0.02, "floor": {"moved_share": 0.0}}})
    rec.add("error", "divergence", finding)
    return rec


@pytest.mark.parametrize("fault, code", [("window", 1), (None, 0)])
def test_a_sliding_window_failure_reproduces_in_one_engine_its_decode_then_prefills_at_the_cuts(tmp_path, fault, code):
    """The batch decodes past the window, then each (prompt, cut) is prefilled for one token: a decode that read
    freed blocks differs from the prefill at the cuts past position 4 (not at the cut at 2); a clean one agrees."""
    from kvdiag.checks.paths.repro import script

    rec = window_case(fault)
    (tmp_path / "repro.py").write_text(script(rec, RunRecord("kvdiag paths", "", [rec], {})))
    p = run_script(tmp_path / "repro.py")
    assert p.returncode == code, p.stdout + p.stderr
    if fault:
        assert "REPRODUCED: 3 of 4 requests differ" in p.stdout and "request 0 at 5: token 0 is" in p.stdout
    alone = script(window_case(fault, "sliding-window, the batch against each prompt alone: 40% of positions moved"),
                   RunRecord("kvdiag paths", "", [], {}))  # the batch against each prompt alone, not the cuts
    (tmp_path / "alone.py").write_text(alone)
    p = run_script(tmp_path / "alone.py")
    assert p.returncode == code and "'share': {'moved_by': 0.01, 'allowed': 0.03}" in alone, p.stdout + p.stderr
    if fault:  # the batch moves off each prompt alone past the window (its first 2 positions inside: not compared)
        assert "request 0: token 2 is" in p.stdout and "REPRODUCED: 3 difference(s)" in p.stdout, p.stdout
    ref, spec = records("spec-ngram", "token")  # speculative decoding: held to its reference case's engine, as any
    assert "'engines': {'reference'" in script(spec, RunRecord("kvdiag paths", "", [ref, spec], {}))


def test_no_script_for_a_passing_case_or_an_engine_that_records_no_start(tmp_path):
    from kvdiag.checks.paths.repro import script

    ref, rec = records("cudagraph-full", "token", status="pass")
    assert script(rec, RunRecord("kvdiag paths", "", [ref, rec], {}, run_dir=str(tmp_path))) is None
    ref, rec = records("cudagraph-full", "token")
    del rec.metrics["replay"]
    assert script(rec, RunRecord("kvdiag paths", "", [ref, rec], {}, run_dir=str(tmp_path))) is None


def flaky(tmp_path, codes: list[int]) -> Path:
    """A script that exits with ``codes`` in turn, one per run (a counter file keeps the count)."""
    s = tmp_path / "flaky.py"
    s.write_text(f"import pathlib, sys\nc = pathlib.Path({str(tmp_path / 'n')!r})\nn = int(c.read_text()) if "
                 f"c.exists() else 0\nc.write_text(str(n + 1))\nprint('run', n)\nsys.exit({codes!r}[n])\n")
    return s


@pytest.mark.parametrize("codes, verdict, runs, kind", [
    ([1], "yes", 1, "reproduced"),
    ([0, 1], "intermittent", 2, "reproduced_intermittently"),
    ([0, 0, 0], "no", 3, "not_reproduced"),
    ([2], "not run", 0, "proof_not_run"),
])
def test_a_reproducer_that_disagrees_runs_again_and_the_verdict_gives_the_rate(tmp_path, codes, verdict, runs, kind):
    from kvdiag.proof.runs import attempts, record

    script = flaky(tmp_path, codes)
    rec = Case("paths", "vllm", "/m", "auto", "t", params={}, id="c").result("fail")
    record(rec, script, attempts(script, timeout=60))
    proof = rec.metrics["proof"]
    assert (proof["reproduced"], proof["runs"], proof["exit_codes"]) == (verdict, runs, codes)
    assert [f.kind for f in rec.findings] == [kind]
    assert rec.findings[0].severity == ("warning" if kind.startswith("not_rep") or "intermit" in kind else "info")
    assert f"python3 {script}" in rec.findings[0].message
    log = script.with_suffix(".log").read_text()
    assert log.count("=== run") == len(codes) and f"run {len(codes) - 1}" in log


def test_kvdiag_writes_each_failing_cases_script_into_the_run_and_records_its_proof(tmp_path, monkeypatch, capsys):
    from kvdiag.run.prove import prove_run

    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    ref, rec = records("offload", "token", own_floor_layouts=False)
    run = RunRecord("kvdiag paths", "", [ref, rec], {}, run_dir=str(tmp_path))
    said = []
    prove_run(run, say=said.append)
    script = tmp_path / "repro" / "paths_vllm_m_auto_offload.py"
    assert said[0].startswith("proving 1 failure(s) without kvdiag") and script.exists()
    took = rec.metrics["proof"]["seconds"]
    assert said[1] == f"  {rec.id}: reproduced yes (1 of 1 runs, {took:.0f} s): python3 {script}"
    assert rec.metrics["proof"]["reproduced"] == "yes" and "REPRODUCED" in rec.metrics["proof"]["output"]
    assert "proof" not in ref.metrics  # a passing case has nothing to prove
    from kvdiag.report.html import render_html
    from kvdiag.report.junit import render_junit
    from kvdiag.report.markdown import render_markdown
    from kvdiag.report.table import print_run

    run.exit_code, command = 1, f"python3 {script}"
    for text in (render_markdown(run), render_html(run), render_junit(run)):  # every report says it
        assert command in text
    monkeypatch.setenv("COLUMNS", "80")
    print_run(run)
    out = capsys.readouterr().out
    assert f"{rec.id}: yes:" in out and command in out.splitlines()  # the command whole, on a line of its own


def test_report_bug_writes_an_issue_body_a_maintainer_can_act_on(tmp_path, monkeypatch):
    """`kvdiag report RUN --bug CASE`: vLLM's template's two sections, the environment, expected and actual, the
    whole reproducer and what it printed, and the command; an unknown case is one line and exit 2."""
    from kvdiag.results import write_jsonl, write_run_json
    from kvdiag.run.prove import prove_run

    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    ref, rec = records("offload", "token", own_floor_layouts=False)
    run = RunRecord("kvdiag paths -e vllm -d auto", "", [ref, rec], {"vllm": "0.24.0", "torch": "2.11.0"},
                    run_dir=str(tmp_path), exit_code=1)
    prove_run(run)
    write_jsonl(tmp_path / "results.jsonl", run.cases)
    write_run_json(tmp_path, run)
    p = subprocess.run([sys.executable, "-m", "kvdiag", "report", str(tmp_path), "--bug", rec.id],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    body = p.stdout
    for part in ("### Your current environment", "vllm: 0.24.0", "### 🐛 Describe the bug", "Expected: the offload "
                 "path gives the same greedy tokens", "Actual: offload: request 1 first differs",
                 "Reproduced without kvdiag: yes", "REPRODUCED", "Found by `kvdiag paths -e vllm -d auto`"):
        assert part in body, part
    assert (tmp_path / "repro" / "paths_vllm_m_auto_offload.py").read_text().rstrip() in body
    assert "origin: a local folder" in body  # /m: neither the hub's nor kvdiag's
    p = subprocess.run([sys.executable, "-m", "kvdiag", "report", str(tmp_path), "--bug", "no/such/case"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and rec.id in p.stderr


def test_the_bug_body_says_where_the_model_comes_from(tmp_path):
    """The hub id and revision run.json recorded, a model shipped with kvdiag, one its zoo built."""
    from kvdiag.assets import TINY_MODEL
    from kvdiag.models.zoo import zoo_cache
    from kvdiag.report.bug import model_origin

    hub = {"repo_id": "Qwen/Qwen3-0.6B", "revision": "c1899de", "hash": "sha256:ab"}
    assert model_origin("/hf/models--Qwen--Qwen3-0.6B/snapshots/c1899de", hub) == \
        "Hugging Face hub Qwen/Qwen3-0.6B at revision c1899de; content sha256:ab"
    assert model_origin(str(TINY_MODEL), None) == "shipped with kvdiag (kvdiag/assets/tiny-llama)"
    assert model_origin(str(zoo_cache() / "qwen3"), {}).startswith("built by kvdiag's model zoo")


def test_compare_keeps_whether_each_sides_failure_reproduced(tmp_path):
    from kvdiag.report.baseline import side_of_run
    from kvdiag.report.compare import compare

    _, old = records("offload", "token", own_floor_layouts=False)
    _, new = records("offload", "token", own_floor_layouts=False)
    new.metrics["proof"] = {"script": "/r/repro/x.py", "reproduced": "intermittent", "runs": 3, "hits": 1,
                            "exit_codes": [0, 0, 1], "output": ""}
    result = compare(side_of_run(RunRecord("a", "", [old], {}, run_dir="A")),
                     side_of_run(RunRecord("b", "", [new], {}, run_dir="B")))
    (said,) = [r for r in result["rows"] if r["what"] == "reproduced without kvdiag"]
    assert (said["old"], said["new"], said["message"]) == ("-", "yes (1 of 3 runs): intermittent",
                                                            "python3 /r/repro/x.py")


def test_a_vllm_fault_is_named_from_its_self_test_catalogue_and_a_wrong_one_is_refused_with_the_valid_ones():
    """`kvdiag paths -e vllm --fault NAME`: the failing case whose proof the nightly test runs with and without the
    fault's patch (tests/integration/test_vllm_proof.py)."""
    from kvdiag.checks.cases import resolve_faults
    from kvdiag.engines.vllm.selftest import CATALOGUE
    from kvdiag.errors import UserError

    assert resolve_faults("vllm", ["prefix_hit_block_dropped"]) == ["prefix_hit_block_dropped"]
    with pytest.raises(UserError) as e:
        resolve_faults("vllm", ["prefix_hit_treated_fresh"])  # the builtin engine's, not vLLM's
    assert "not a fault of engine 'vllm'" in str(e.value) and all(n in str(e.value) for n in CATALOGUE.names)


@pytest.mark.parametrize("patch, proved", [("import os\nos.environ['FAKE_VLLM_FAULT'] = 'hit'\n", True),
                                           ("pass\n", False)])
def test_selftest_prove_holds_each_caught_faults_reproducer_to_its_patch(tmp_path, monkeypatch, patch, proved):
    """`kvdiag selftest --prove`: the fault's reproducer reproduces with the patch in its engine's process and not
    without it, or the self-test fails; the patch reaches only the script's engine processes (the `--run` ones)."""
    from kvdiag.checks.selftest import proofs
    from kvdiag.checks.selftest.view import verdict

    class Traits:
        @staticmethod
        def fault_patch(faults, kv_cache_dtype):
            assert faults == ["f1"] and kv_cache_dtype == "auto"
            return patch

    monkeypatch.setattr("kvdiag.engines.base.engine_traits", lambda engine: Traits())
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    rec = own("prefix-hit", None)  # as kvdiag recorded it: the fault was in kvdiag's worker, not in the arguments
    rec.params["selftest"] = "f1"
    row = {"fault": "f1", "intended": "paths", "status": "caught", "caught_by_intended": True}
    run = RunRecord("kvdiag selftest -e vllm --prove", "", [rec], {}, run_dir=str(tmp_path),
                    analysis={"selftest": {"faults": [row], "clean": {}, "ok": True}})
    proofs.prove_faults(run, "vllm")
    assert (row["proof"]["patched"], row["proof"]["plain"]) == ((1, 0) if proved else (0, 0))
    assert run.analysis["selftest"]["ok"] is proved
    assert verdict(run.analysis["selftest"])[0] is proved
    if not proved:
        assert "not proved outside kvdiag: f1" in verdict(run.analysis["selftest"])[1]


@pytest.mark.parametrize("code, verdict", [("raise RuntimeError('CUDA error: an illegal memory access')", "yes"),
                                           ("print('started')", "no")])
def test_a_crash_inside_the_engine_is_proved_with_its_own_command_whatever_the_check(tmp_path, code, verdict):
    """A crashed case whose finding carries the engine's command (kvdiag.engines.base.reproducer): the command in a
    script, run without kvdiag; it reproduces when the command dies again."""
    import shlex

    from kvdiag.run.prove import prove_run

    rec = Case("accuracy", "vllm", "/m", "fp8", "t", params={}, id="accuracy/vllm/m/fp8").result("crashed")
    rec.add("error", "crashed", "engine start: RuntimeError", reproduce="python3 -c " + shlex.quote(code))
    run = RunRecord("kvdiag accuracy -e vllm", "", [rec], {}, run_dir=str(tmp_path))
    prove_run(run)
    assert rec.metrics["proof"]["reproduced"] == verdict
    if verdict == "yes":
        assert "illegal memory access" in rec.metrics["proof"]["output"]


def test_a_restart_that_fails_in_one_fresh_process_of_two_is_said_intermittent(tmp_path):
    """memleak's restart_impossible carries the plain restart's command: where the engine restarts in one fresh
    process and asserts in the next (vLLM's defaults on an H200), the proof says the rate, not "the same way"."""
    import shlex

    from kvdiag.run.prove import prove_run

    count = tmp_path / "n"
    code = (f"import pathlib, sys; c = pathlib.Path({str(count)!r}); n = int(c.read_text()) if c.exists() else 0; "
            "c.write_text(str(n + 1)); print('plain restart: started again') if n % 2 == 0 else "
            "sys.exit('RuntimeError: it->second->use_count > 0')")
    rec = Case("memleak", "vllm", "/m", "auto", "t", params={}, id="memleak/vllm/m/auto").result("fail")
    rec.add("error", "restart_impossible", "cycle 2: the engine cannot be started again in this process",
            reproduce="python3 -c " + shlex.quote(code))
    run = RunRecord("kvdiag memleak -e vllm", "", [rec], {}, run_dir=str(tmp_path))
    prove_run(run)
    proof = rec.metrics["proof"]
    assert (proof["reproduced"], proof["hits"], proof["runs"]) == ("intermittent", 1, 2)
    (said,) = [f for f in rec.findings if f.kind == "reproduced_intermittently"]
    assert "reproduced 1 of 2 runs without kvdiag" in said.message and "intermittent" in said.message



def test_strict_makes_a_failure_that_does_not_reproduce_outside_kvdiag_an_error(tmp_path, monkeypatch):
    """A failing case whose reproducer does not reproduce (the engine alone matches the reference: kvdiag's failure
    had no fault behind it) is, with --strict, an error of the case, not a warning; each check command passes
    --strict down to the proofs."""
    from typer.testing import CliRunner

    from kvdiag.cli.app import app
    from kvdiag.run.prove import prove_run

    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    ref, rec = records("offload", None, own_floor_layouts=False)
    prove_run(RunRecord("kvdiag paths", "", [ref, rec], {}, run_dir=str(tmp_path)), strict=True)
    assert rec.metrics["proof"]["reproduced"] == "no" and rec.metrics["proof"]["runs"] == 3
    (said,) = [f for f in rec.findings if f.kind == "not_reproduced"]
    assert said.severity == "error"
    calls = []
    monkeypatch.setattr("kvdiag.api.run_check", lambda *a, **kw: calls.append(kw) or RunRecord("k", "", [], {}))
    for argv, strict in ((["wake-cycle", "--strict"], True), (["poison"], False)):
        CliRunner().invoke(app, argv)
        assert calls.pop()["strict"] is strict
