"""A paths case whose engine raised in a generate call (not only at its start) gets a reproducer
(kvdiag/checks/paths/repro.py's ``crashed``, kvdiag.proof's call_script.py): the engine started with kvdiag's
arguments and the call that died, in a fresh process; exit 1 when it raises what kvdiag saw, 0 when it completes.
The vLLM side runs against the stand-in vLLM (tests/support/fake_vllm), whose ``crash_alone`` fault raises in a call of
one request; kvdiag's side (what the worker records when a call dies) on the builtin engine, tiny-llama."""

from __future__ import annotations

from test_proof_greedy import prove_with_patch  # the stand-in vLLM, with a fault's patch in the script's engine

from kvdiag.case import Case

SAW = "IndexError: index -3 is out of bounds for dimension 0 with size 1"


def crashed_case(prompts, raised: str = "IndexError", before=()):
    """A paths case as the check records a crash in a call: its start and the call that died (``died_on``)."""
    case = Case("paths", "vllm", "/m", "auto", "t", params={"path": "spec-ngram"}, id="paths/vllm/m/auto/spec-ngram")
    replay = {"engine": "vllm", "llm": {"model": "/m", "enforce_eager": True}, "sampling": {},
              "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    rec = case.result("crashed", metrics={"replay": replay, "died_on": {
        "prompts": prompts, "max_tokens": 8, "logprobs": 2, "raised": raised, "what": "the path's run",
        "before": list(before)}})
    rec.add("error", "crashed", f"spec-ngram (the path's run): {SAW}", stage="spec-ngram (the path's run)")
    return rec


def test_the_call_that_died_dies_again_with_the_faults_patch_and_completes_without(tmp_path, monkeypatch):
    """`selftest --prove`: the stand-in vLLM with the fault raises in the one-request call kvdiag saw die (exit 1,
    expected against observed in vLLM's words); without it the call completes (exit 0)."""
    row, _ = prove_with_patch(tmp_path, monkeypatch, crashed_case([[5, 6, 7]]), "crash_alone")
    proof = row["proof"]
    assert (proof["patched"], proof["plain"]) == (1, 0), proof["patched_output"] + proof["output"]
    assert "expected: the call completes: 1 prompt(s), 8 greedy tokens each" in proof["patched_output"]
    assert f"observed: call 1 (1 prompt(s), 8 tokens) raised {SAW}" in proof["patched_output"]
    assert "NOT REPRODUCED: nothing raised" in proof["output"]


def test_a_call_that_dies_only_after_the_calls_before_it_is_made_after_them(tmp_path, monkeypatch):
    """The call alone completes in a fresh engine; the script then makes the calls kvdiag made before it (the
    prefix cache emptied, a batch) in another, where it dies as kvdiag saw."""
    before = [{"reset": True}, {"prompts": [[1, 2], [3, 4]], "max_tokens": 8, "logprobs": 2}]
    rec = crashed_case([[5, 6, 7]], raised="RuntimeError", before=before)
    row, _ = prove_with_patch(tmp_path, monkeypatch, rec, "crash_later")
    proof = row["proof"]
    assert (proof["patched"], proof["plain"]) == (1, 0), proof["patched_output"] + proof["output"]
    assert "the call alone completed; again, after the 2 call(s) kvdiag made before it" in proof["patched_output"]
    assert "call 3 (1 prompt(s), 8 tokens) raised RuntimeError: CUDA error: device-side assert" in \
        proof["patched_output"]


def test_a_call_kvdiags_worker_died_in_is_reproduced_by_the_engines_process_dying(tmp_path, monkeypatch):
    """No exception kept (kvdiag's worker died in the call; what it kept before the call): the script's engine
    process dying in the same call reproduces it; completing does not."""
    rec = crashed_case([[5, 6, 7]])
    del rec.metrics["died_on"]["raised"]
    row, _ = prove_with_patch(tmp_path, monkeypatch, rec, "die_alone")
    proof = row["proof"]
    assert (proof["patched"], proof["plain"]) == (1, 0), proof["patched_output"] + proof["output"]
    assert "the engine's process died during a call (exit 134)" in proof["patched_output"]
    assert "the engine died in a generate call" in proof["patched_output"]


def test_a_call_that_raises_otherwise_is_not_called_reproduced(tmp_path, monkeypatch):
    row, _ = prove_with_patch(tmp_path, monkeypatch, crashed_case([[5, 6, 7]], raised="RuntimeError"), "crash_alone")
    assert row["proof"]["patched"] == 2 and "DIED OTHERWISE: IndexError, where kvdiag saw RuntimeError" in \
        row["proof"]["patched_output"]


def test_kvdiag_records_the_call_that_died_and_the_engines_start(monkeypatch):
    """The paths worker, on the builtin engine whose second generate call raises: a crashed record that carries the
    start (``replay``) and the call (its prompts as token ids, tokens, logprobs, the exception's type, the calls
    before it)."""
    from types import SimpleNamespace

    from kvdiag.assets import TINY_MODEL
    from kvdiag.checks.paths.repro import script
    from kvdiag.checks.paths.run import run
    from kvdiag.engines.builtin.engine import BuiltinEngine

    made = []

    def dies(self, prompts, max_tokens, **kw):  # the second call dies
        made.append(prompts)
        if len(made) > 1:
            raise IndexError("index -3 is out of bounds for dimension 0 with size 1")
        return real(self, prompts, max_tokens, **kw)

    real = BuiltinEngine.generate

    monkeypatch.setattr(BuiltinEngine, "generate", dies)
    case = Case("paths", "builtin", str(TINY_MODEL), "auto", "t", id="paths/builtin/tiny/auto/prefix-hit",
                params={"path": "prefix-hit", "num_prompts": 2, "max_tokens": 4, "device": "cpu"})
    kept = []
    rec = run(case, SimpleNamespace(stage=lambda *a: None, keep=lambda c, stage, **m: kept.append(m)))
    assert rec.status == "crashed", rec.findings
    died = rec.metrics["died_on"]
    assert (died["max_tokens"], died["logprobs"], died["raised"]) == (4, 2, "IndexError")
    assert len(died["prompts"]) == 2 and all(isinstance(t, int) for p in died["prompts"] for t in p)
    assert rec.metrics["replay"]["engine"] == "builtin"
    calls = [s for s in died["before"] if not s.get("reset")]  # the call before it, as the engine got it
    assert [c["prompts"] for c in calls] == [list(map(list, made[0]))] and calls[0]["max_tokens"] == 4
    ns: dict = {"__name__": "reproducer"}
    exec(compile(script(rec, None), "r.py", "exec"), ns)
    assert ns["CASE"]["calls"] == [{k: died[k] for k in ("prompts", "max_tokens", "logprobs")}]
    assert ns["CASE"]["raises"] == "IndexError"
    # kept as the worker went (what a worker that dies leaves): the start, then each call before it is made
    assert kept[0] == {"replay": rec.metrics["replay"]}
    same = ("prompts", "max_tokens", "logprobs", "before")
    assert {k: kept[-1]["died_on"][k] for k in same} == {k: died[k] for k in same}
