"""`kvdiag accuracy` on the conversation tasks (kv_decode, kv_multiturn) with decoded drift (--drift-decoded), the
whole command on the shipped model: scores per chain length, a dtype computed as the baseline identical everywhere,
a quantized one drifting along its own continuation, and the tables that show it."""

import json

import pytest
from test_accuracy import by_dtype, kvdiag

TOKENS = 64


@pytest.mark.slow
def test_conversations_and_decoded_drift_through_the_command(tmp_path):
    run_dir = tmp_path / "run"
    r = kvdiag("accuracy", "-t", "kv_decode,kv_multiturn", "--limit", "5", "-d", "auto", "-d", "bfloat16", "-d",
               "fp8_e5m2", "--drift-decoded", str(TOKENS), "--isolate", "run", "-f", "json", "-o", str(run_dir))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    run = json.loads(r.stdout)
    cases = {c["kv_dtype"]: c for c in run["cases"]}
    assert all(c["params"]["prefix_caching"] is True for c in run["cases"])  # the turns read the cache back
    scores = cases["auto"]["metrics"]["scores"]
    assert {m: s["n"] for m, s in scores["kv_decode"].items()} == {
        "exact_match": 5, "exact_match_len1": 1, "exact_match_len2": 1, "exact_match_len4": 1, "exact_match_len8": 1,
        "exact_match_len16": 1}  # the first 5 documents take the lengths in turn
    per_length = [s["score"] * s["n"] for m, s in scores["kv_decode"].items() if m != "exact_match"]
    assert scores["kv_decode"]["exact_match"]["score"] == pytest.approx(sum(per_length) / 5)
    assert set(scores["kv_multiturn"]) == {"exact_match", "turns_right"}
    assert scores["kv_multiturn"]["turns_right"]["score"] >= scores["kv_multiturn"]["exact_match"]["score"] > 0

    # what a score regression's reproducer carries inline, kept once (the baseline's): each document's request,
    # the document, its target and answer, and each task's scoring (its custom process_results as its file's text)
    import gzip

    from kvdiag.checks.accuracy.harness.lm_eval_generations import SCORING

    with gzip.open(run_dir / "artifacts" / cases["auto"]["metrics"]["artifacts"]["requests"], "rt") as f:
        kept = json.load(f)
    for task, process in (("kv_decode", "process_decode"), ("kv_multiturn", "process_turns")):
        assert sorted(kept[task]) == list("01234") and kept[SCORING][task]["max_length"] > 0
        assert kept[SCORING][task]["config"]["process_results"]["@function"] == process
        doc = kept[task]["0"]
        assert doc["type"] == "generate_until" and doc["target"] == doc["doc"]["target"]
        assert doc["arguments"][0][1]["until"] == [" ", ";"] and doc["arguments"][0][0] == doc["doc"]["context"]

    rows = by_dtype(run["analysis"]["accuracy"]["rows"])
    for row in rows["bfloat16"]:  # bit for bit auto: every turn of every document the same
        assert (row["delta"], row["verdict"]) == (0.0, "ok"), row
    decoded = {c["kv_dtype"]: c["metrics"]["drift"]["decoded"] for c in run["cases"] if c["kv_dtype"] != "auto"}
    same, quantized = decoded["bfloat16"], decoded["fp8_e5m2"]
    assert (same["mean_kl"], same["max_kl"], same["first_divergence"], same["diverged"]) == (0, 0, None, 0)
    assert same["tokens"] == TOKENS
    assert quantized["mean_kl"] > 0 and quantized["first_divergence"] is not None
    assert "decoded" not in cases["auto"]["metrics"].get("drift", {})  # the baseline is not compared with itself
    spans = [(b["from"], b["to"]) for b in cases["fp8_e5m2"]["metrics"]["drift"]["by_position"]["decoded"]]
    assert spans == [(1, 16), (17, 32), (33, 64)]

    assert kvdiag("report", str(run_dir)).returncode == 0
    md = (run_dir / "report.md").read_text()
    assert "## Decoded drift" in md and "| bfloat16 | 64 |" in md and "| fp8_e5m2 | decoded continuation |" in md
