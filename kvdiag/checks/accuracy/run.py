"""The accuracy check in the worker (the registry's target)."""

from __future__ import annotations

import gzip
import json
import threading
import time

from kvdiag.checks.accuracy import drift_decoded
from kvdiag.checks.accuracy.harness.lm_eval_options import AUTO_BATCH
from kvdiag.checks.common import compiled, engine_failed, model_dtype, replay_of, start_or_record
from kvdiag.checks.sweep import drift
from kvdiag.checks.sweep.drift import DRIFT
from kvdiag.checks.sweep.engine_use import acquire_engine, release_engine, startup_once
from kvdiag.engines.protocol import ModelFacts, SharesWeights
from kvdiag.errors import UserError

SAMPLES = ".samples.json"
REQUESTS = ".requests.json.gz"  # the baseline's lm_eval requests per document (lm_eval_results.requests)


# ------------------------------------------------------------------ worker side


def run_case(case, ctx):
    """One dtype: drift probe, then the lm_eval tasks."""
    from kvdiag.checks.accuracy.harness.lm_eval_adapter import EngineLM, run_tasks
    from kvdiag.checks.prompts import case_prompts

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
        prompts = case_prompts(case)
        probe = drift.collect(engine, prompts)
        if p.get("drift_decoded") and p.get("role") != "baseline":
            probe["decoded"] = drift_decoded.collect(engine, prompts, p["drift_decoded"])
        drift.save(probe, ctx.artifact(case, DRIFT))
        times["drift"] = _lap(t)
        # kept at once: lm_eval's requests may kill the worker (a segfault in the engine) and take the drift with it
        kept = {"model_dtype": model_dtype(engine, case), "compiled": compiled(engine), "finite": drift.finite(probe),
                "drift_over": probe["over"], "timings": dict(times),
                "artifacts": {"drift": ctx.artifact(case, DRIFT).name},
                **{k: v for k, v in replay_of(engine, []).items() if k == "replay"}}  # what a reproducer starts
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
    arts = {"samples": ctx.artifact(case, SAMPLES).name}
    if p.get("role") == "baseline" and out.get("requests"):  # what a score regression's reproducer carries inline:
        with gzip.open(ctx.artifact(case, REQUESTS), "wt") as f:  # the same for every dtype, kept once
            json.dump(out["requests"], f)
        arts["requests"] = ctx.artifact(case, REQUESTS).name
    times["lm_eval"], times["lm_eval_in_engine"] = _lap(t), round(lm.engine_seconds, 3)
    # the audit after lm_eval: reading a hybrid model's cache on vLLM wraps its block pool (engines/vllm/hybrid.py)
    kept["storage"] = cache_storage(engine)
    if out["cells"]:  # kv_needle's documents: the grid cell of each (checks/accuracy/needle.py scores them)
        kept["needle_cells"] = out["cells"]
    ctx.keep(case, "lm_eval", scores=out["scores"], lm_eval=out["settings"], timings=dict(times),
             storage=kept["storage"], artifacts=arts,
             **{k: kept[k] for k in ("needle_cells",) if k in kept})  # shutdown may crash
    released, decoded_error = False, None
    if p.get("drift_decoded") and p.get("role") != "baseline":
        ctx.stage(case, "decoded drift")
        t, released = time.perf_counter(), not isinstance(engine, SharesWeights)  # else shut down for the baseline's
        try:
            drift_decoded.rescore(case, engine, probe, prompts)
            drift.save(probe, ctx.artifact(case, DRIFT))
        except Exception as e:  # noqa: BLE001 - the baseline dtype's engine failed here: the scores stand
            from kvdiag.errors import first_line

            decoded_error = f"decoded drift: the baseline dtype's engine failed: {type(e).__name__}: {first_line(e)}"
        times["drift_decoded"] = _lap(t)
    ctx.stage(case, "shutdown")
    times["cpu"] = round(_cpu_time() - cpu, 3)
    metrics = {"scores": out["scores"], "lm_eval": out["settings"], **kept, "timings": times,
               "worker": _worker_info(engine), **documents(out["scores"], times["lm_eval"]), "peak_mib": peak_mib(),
               "artifacts": {**arts, "drift": ctx.artifact(case, DRIFT).name}}
    if not released:
        release_engine(case, engine)
    rec = case.result("pass", metrics=metrics)
    if decoded_error:
        rec.add("warning", "decoded_drift", decoded_error[:500])
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
    from kvdiag.checks.sweep.storage_audit import cache_storage as audit

    try:
        return audit(engine)
    except Exception as e:  # noqa: BLE001 - an engine whose cache cannot be read (vLLM: KVAccessError)
        print(f"kvdiag: no storage audit of this cache: {type(e).__name__}: {e}", flush=True)
        return None


def chat_tokenizer(model: str):
    """The model's Hugging Face tokenizer, for its chat template (--apply-chat-template)."""
    from kvdiag.models import hf_tokenizer

    return hf_tokenizer(model)


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
            "weight_loads": engine.weight_loads if isinstance(engine, SharesWeights) else None}


def _cpu_time() -> float:
    """CPU seconds of this case: the process's on the main thread (its torch threads included); of this thread
    alone when cases run on threads (each then runs its torch ops on one or two threads of its own)."""
    return time.process_time() if threading.current_thread() is threading.main_thread() else time.thread_time()


def _max_len(engine, params) -> int:
    own = engine.max_model_len if isinstance(engine, ModelFacts) else 0
    return int(own or params.get("max_model_len") or 2048)


def _lap(t0: float) -> float:
    return round(time.perf_counter() - t0, 3)


# ------------------------------------------------------------------ parent side


