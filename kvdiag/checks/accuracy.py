"""The accuracy check: lm_eval + token-level drift per kv dtype, judged against a baseline dtype.

Worker side (``run_case``, one call per dtype): start the engine, save the drift probe
(``checks/drift.py``) and lm_eval's per-document results as artifacts. Parent side
(``analyze``): pair every dtype's documents with the baseline's, run the paired test,
measure drift, and give each dtype a verdict (``verdicts.py``).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvdiag.checks import drift
from kvdiag.checks.common import engine_failed, start_or_record
from kvdiag.checks.engine_use import acquire_engine, release_engine, startup_once
from kvdiag.checks.registry import Check, option
from kvdiag.errors import UserError
from kvdiag.evaluation.lm_eval_options import AUTO_BATCH
from kvdiag.models import config_dtype

SAMPLES = ".samples.json"
DRIFT = ".drift.npz"


# ------------------------------------------------------------------ worker side


def drift_limit(name: str):
    """The drift limits accuracy and dtypes --check both take."""
    if name == "max_kl":
        return option(None, "--max-kl", min=0, help="Mean KL(baseline||dtype) allowed per position for every dtype "
                      "that need not be bit-identical (default: per dtype family, see docs).")
    return option(None, "--min-top1", min=0, max=1, help="Top-1 agreement with the baseline required (default: per "
                  "dtype family).")


@dataclass
class AccuracyParams:
    tasks: list[str] = option([], "--tasks", "-t", help="lm_eval task names or globs (comma-separated or repeated). "
                              "Default: kvdiag's shipped tasks (kv_recall, kv_recall_long); it also ships the harder "
                              "kv_recall_p128, kv_recall_p152, kv_recall_p176, kv_recall_p176_early (longer than the "
                              "tiny models were trained on: scores below 1, for zoo models), and kv_recall_p450_early, "
                              "kv_recall_p550_early (4-6k tokens: zoo:gemma3's, with -a max_model_len=8192). Any "
                              "lm_eval task works "
                              "(indexing lm_eval's tasks adds ~7 s).")
    include_paths: list[str] = option([], "--include-path", help="A folder of your own lm_eval task YAML files; "
                                      "repeatable.")
    baseline: str = option("auto", "--baseline", help="The kv dtype every other dtype is compared with.")
    limit: float | None = option(None, "--limit", help="Documents per task (an int), or a fraction of each "
                                 "task when < 1 (as in lm_eval).")
    num_fewshot: int | None = option(None, "--num-fewshot", min=0, help="Few-shot examples (lm_eval).")
    seed: int = option(0, "--seed", help="Random seed for sampling and for lm_eval.")
    batch_size: str = option("auto", "--batch-size", "-b", help="Requests per engine call: an integer, or auto "
                             f"({AUTO_BATCH}: the engine schedules them).")
    apply_chat_template: str | None = option(None, "--apply-chat-template", help="Format prompts with the "
                                             "model's chat template, as lm_eval: alone, the tokenizer's template; "
                                             "--apply-chat-template NAME, that one of its templates.")
    fewshot_as_multiturn: bool | None = option(None, "--fewshot-as-multiturn/--no-fewshot-as-multiturn",
                                               help="Few-shot examples as a multi-turn conversation (default: on "
                                               "with --apply-chat-template, as lm_eval).")
    system_instruction: str | None = option(None, "--system-instruction", help="A system instruction before "
                                            "every prompt (lm_eval).")
    gen_kwargs: str | None = option(None, "--gen-kwargs", help="Generation arguments for every generating task, "
                                    "key=value,key=value or a JSON object (e.g. max_gen_toks=512,temperature=0); "
                                    "they update each task's own.")
    metadata: str | None = option(None, "--metadata", help="Task metadata, key=value,key=value or a JSON object "
                                  "(e.g. '{\"max_seq_lengths\": [4096]}' for RULER); kvdiag adds pretrained=MODEL "
                                  "and the --engine-arg values, as lm_eval merges model_args.")
    max_drop: float = option(0.02, "--max-drop", min=0, help="A drop (in the metric's units, e.g. 0.02 = 2 points "
                             "of acc) larger than this and significant at --alpha is a regression.")
    alpha: float = option(0.05, "--alpha", min=0, max=1, help="Significance level of the paired test.")
    max_kl: float | None = drift_limit("max_kl")
    min_top1: float | None = drift_limit("min_top1")


def run_case(case, ctx):
    """One dtype: drift probe, then the lm_eval tasks."""
    from kvdiag.checks.prompts import case_prompts
    from kvdiag.evaluation.lm_eval_adapter import EngineLM, run_tasks

    p, times = case.params, {"startup": startup_once()}
    t, cpu = time.perf_counter(), _cpu_time()
    _reset_peak()
    ctx.stage(case, "engine start")
    engine, refused_rec = start_or_record(case, acquire_engine)
    if refused_rec is not None:
        return refused_rec
    times["engine_start"] = _lap(t)
    stage, kept = "drift probe", {}
    try:
        ctx.stage(case, stage)
        t = time.perf_counter()
        probe = drift.collect(engine, case_prompts(case))
        drift.save(probe, ctx.artifact(case, DRIFT))
        times["drift"] = _lap(t)
        # kept at once: lm_eval's requests may kill the worker (a segfault in the engine) and take the drift with it
        kept = {"model_dtype": model_dtype(engine, case), "compiled": compiled(engine), "finite": drift.finite(probe),
                "drift_over": probe["over"], "timings": dict(times),
                "artifacts": {"drift": ctx.artifact(case, DRIFT).name}}
        ctx.keep(case, stage, **kept)
        stage, t = "lm_eval", time.perf_counter()
        ctx.stage(case, stage)
        lm = EngineLM(engine, max_length=_max_len(engine, p), seed=p.get("seed", 0),
                      batch_size=p.get("batch_size") or AUTO_BATCH,
                      chat_tokenizer=chat_tokenizer(case.model) if p.get("apply_chat_template") else None,
                      on_progress=lambda text: ctx.progress(case, text))
        out = run_tasks(lm, p["tasks"], include_paths=tuple(p.get("include_paths") or ()),
                        include_defaults=bool(p.get("include_defaults")), limit=p.get("limit"),
                        num_fewshot=p.get("num_fewshot"), seed=p.get("seed", 0),
                        **{k: p.get(k) for k in LM_EVAL_KEYS if p.get(k) is not None})
    except UserError:
        raise  # bad input (a task lm_eval cannot load, a prompt too long): kvdiag's error, not the engine's
    except Exception as e:  # noqa: BLE001 - it started, then failed: a crash of this dtype
        rec = engine_failed(case, e, stage, started=True, timings=times)
        rec.metrics = {**kept, **rec.metrics}  # the drift it measured before, as a dead worker's record has it
        return rec
    ctx.artifact(case, SAMPLES).write_text(json.dumps(out["samples"]))
    times["lm_eval"], times["lm_eval_in_engine"] = _lap(t), round(lm.engine_seconds, 3)
    # the audit after lm_eval: reading a hybrid model's cache on vLLM wraps its block pool (engines/vllm/hybrid.py)
    kept["storage"] = cache_storage(engine)
    ctx.keep(case, "lm_eval", scores=out["scores"], lm_eval=out["settings"], timings=dict(times),
             storage=kept["storage"], artifacts={"samples": ctx.artifact(case, SAMPLES).name})  # shutdown may crash
    ctx.stage(case, "shutdown")
    times["cpu"] = round(_cpu_time() - cpu, 3)
    metrics = {"scores": out["scores"], "lm_eval": out["settings"], **kept, "timings": times,
               "worker": _worker_info(engine), **documents(out["scores"], times["lm_eval"]), "peak_mib": peak_mib(),
               "artifacts": {"samples": ctx.artifact(case, SAMPLES).name, "drift": ctx.artifact(case, DRIFT).name}}
    release_engine(case, engine)
    rec = case.result("pass", metrics=metrics)
    cut = lm.truncation()
    if cut["truncated"]:
        rec.add("warning", "truncated", f"{cut['truncated']} of {cut['requests']} lm_eval requests were longer than "
                f"the engine's max length ({cut['max_length']} tokens; the longest {cut['longest']}) and lost the "
                "start of their context (as lm_eval's own models cut it): their scores measure the cut; give the "
                "engine room with -a max_model_len=N (up to the model's max_position_embeddings)", **cut)
    return rec


LM_EVAL_KEYS = ("apply_chat_template", "fewshot_as_multiturn", "system_instruction", "gen_kwargs", "metadata")


def cache_storage(engine) -> dict | None:
    """The storage audit of the engine's cache (``storage_audit.cache_storage``, as `kvdiag dtypes --check` has it);
    None when the engine cannot show its cache. Never the case's failure: the audit only informs a warning."""
    from kvdiag.checks.storage_audit import cache_storage as audit

    try:
        return audit(engine)
    except Exception as e:  # noqa: BLE001 - an engine whose cache cannot be read (vLLM: KVAccessError)
        print(f"kvdiag: no storage audit of this cache: {type(e).__name__}: {e}", flush=True)
        return None


def chat_tokenizer(model: str):
    """The model's Hugging Face tokenizer, for its chat template (--apply-chat-template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _reset_peak() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def peak_mib() -> dict:
    """This case's peak of device memory torch allocated (None on the CPU), and the worker process's peak resident
    memory (since it started: shared by the cases of an --isolate run worker)."""
    import resource
    import sys

    torch = sys.modules.get("torch")
    gpu = torch.cuda.max_memory_allocated() / 2**20 if torch is not None and torch.cuda.is_initialized() else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"gpu": None if gpu is None else round(gpu, 1), "rss": round(rss, 1)}


def documents(scores: dict, seconds: float) -> dict:
    """Documents scored (each task's, counted once) and how many a second lm_eval took for them."""
    n = sum(max((m.get("n") or 0 for m in per.values()), default=0) for per in scores.values())
    return {"documents": n, "documents_per_s": round(n / seconds, 2) if seconds else None}


def _worker_info(engine) -> dict:
    """Where the case ran: process, thread, and how often its engine object read weights from disk (0: it shares
    another thread's, ``--isolate run`` on the CPU)."""
    import os

    return {"pid": os.getpid(), "thread": threading.current_thread().name,
            "weight_loads": getattr(engine, "weight_loads", None)}


def _cpu_time() -> float:
    """CPU seconds of this case: the process's on the main thread (its torch threads included); of this thread
    alone when cases run on threads (each then runs its torch ops on one or two threads of its own)."""
    return time.process_time() if threading.current_thread() is threading.main_thread() else time.thread_time()


def model_dtype(engine, case) -> str | None:
    """The dtype the weights run in (what ``auto`` stores the KV cache in)."""
    d = getattr(engine, "dtype", None)
    if d is not None and not callable(d):
        return str(d).removeprefix("torch.")
    return config_dtype(case.model)


def compiled(engine) -> bool:
    """Whether the engine runs a compiled model (vLLM's defaults; not with enforce_eager): drift.limits_for."""
    return bool(getattr(engine, "compiled", False))


def _max_len(engine, params) -> int:
    return int(getattr(engine, "max_model_len", 0) or params.get("max_model_len") or 2048)


def _lap(t0: float) -> float:
    return round(time.perf_counter() - t0, 3)


# ------------------------------------------------------------------ parent side


def artifact_path(run, rec, kind: str) -> Path:
    return Path(run.run_dir) / "artifacts" / rec.metrics["artifacts"][kind]


def analyze(run, *, baseline: str, max_drop: float, alpha: float, max_kl: float | None = None,
            min_top1: float | None = None) -> None:
    """Compare every dtype's case with the baseline case; set verdicts, statuses, findings, run.analysis."""
    from kvdiag.checks import verdicts
    from kvdiag.results import append_jsonl

    for rec in run.cases:
        verdicts.reset(rec)
    base = next((c for c in run.cases if c.kv_dtype == baseline and c.params.get("role") == "baseline"), None)
    rows, changed, by_position = [], [], []
    base_ok = base is not None and base.status == "pass"
    base_samples = json.loads(artifact_path(run, base, "samples").read_text()) if base_ok else {}
    base_probe = drift.load(artifact_path(run, base, "drift")) if base_ok else None
    for rec in run.cases:
        if rec is base:
            rows += verdicts.baseline_rows(rec)
            changed.append(rec)  # its verdict 'baseline' goes into results.jsonl too
        elif (wrong := drift.wrongly_refused(rec, base)) is not None:
            rec.status = "fail"
            rec.add("error", "wrong", wrong)
            rows += verdicts.failed_rows(rec)
            changed.append(rec)
        elif rec.status != "pass":
            d = _kept_drift(run, rec, base, base_probe, max_kl, min_top1)
            if d is not None:  # a case whose worker died after its drift probe: its drift is shown and judged
                verdicts.add_unchanged(rec, base, d)
                by_position += [r for r in [verdicts.position_row(rec)] if r]
                changed.append(rec)
            rows += verdicts.failed_rows(rec)
        elif not base_ok:
            rec.status = "error"
            rec.add("error", "no_baseline", f"baseline dtype '{baseline}' did not finish; nothing to compare with")
            rows += verdicts.failed_rows(rec)
            changed.append(rec)
        else:
            samples = json.loads(artifact_path(run, rec, "samples").read_text())
            d = drift.compare(base_probe, drift.load(artifact_path(run, rec, "drift")))
            lim = drift.limits_for(rec.kv_dtype, base.metrics.get("model_dtype"),
                                   compiled=drift.compiled_pair(rec, base), max_kl=max_kl, min_top1=min_top1)
            rows += verdicts.judge_case(rec, base, base_samples, samples, d, lim, max_drop=max_drop, alpha=alpha)
            verdicts.add_unchanged(rec, base, d)
            by_position += [r for r in [verdicts.position_row(rec)] if r]
            changed.append(rec)
    for rec in changed:
        append_jsonl(Path(run.run_dir) / "results.jsonl", rec)
    run.analysis["accuracy"] = {"baseline": baseline, "max_drop": max_drop, "alpha": alpha, "rows": rows,
                                "drift_by_position": by_position, "timings": total_timings(run.cases)}


def _kept_drift(run, rec, base, base_probe, max_kl, min_top1) -> dict | None:
    """The drift of a case that did not pass but kept its drift probe (``WorkerContext.keep``: its worker died in
    lm_eval), against the baseline's, judged by its family's limits (``verdicts.judge_kept``); None without one."""
    from kvdiag.checks import verdicts

    name = (rec.metrics.get("artifacts") or {}).get("drift")
    path = Path(run.run_dir) / "artifacts" / name if name else None
    if base_probe is None or path is None or not path.exists():
        return None
    d = drift.compare(base_probe, drift.load(path))
    lim = drift.limits_for(rec.kv_dtype, base.metrics.get("model_dtype"), compiled=drift.compiled_pair(rec, base),
                           max_kl=max_kl, min_top1=min_top1)
    verdicts.judge_kept(rec, d, lim)
    return d


def total_timings(cases) -> dict:
    """Seconds summed over the cases, per phase (startup = spawn + imports)."""
    out: dict = {}
    for c in cases:
        for k, v in (c.metrics.get("timings") or {}).items():
            out[k] = round(out.get(k, 0.0) + v, 3)
    return out


CHECK = Check(
    "accuracy", "kvdiag.checks.accuracy:run_case", AccuracyParams,
    help="Score lm_eval tasks and token-level drift for each kv dtype against a baseline dtype.",
    render="kvdiag.report.views:accuracy", plots="kvdiag.report.plots:accuracy_plots",
    compare="kvdiag.report.compare:score_rows", cases="kvdiag.run.cases:accuracy_cases", gpu_share=True,
    # 10 documents of kv_recall: enough for a collapse; drift (measured in every case) catches what they cannot
    selftest={"tasks": ["kv_recall"], "include_paths": [], "include_defaults": False, "limit": 10,
              "num_fewshot": None, "seed": 0, "num_prompts": 2})
