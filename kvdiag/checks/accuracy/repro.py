"""The reproducer of an accuracy score regression (``kvdiag.proof``: a ``regression`` or ``collapse`` row), on an
engine that says how it was started (``protocol.Replayable``; vLLM): the documents whose score changed between the
baseline dtype and the dtype (kvdiag's per-document results, ``artifacts/*.samples.json``), scored again by lm_eval's
vLLM backend with each dtype's engine arguments and the run's lm_eval settings (``lm_eval_docs_script.py``). Where the
task is scored by loglikelihood (multiple choice: ``acc``, ``acc_norm``), the script carries each document's requests
inline as lm_eval made them (the baseline's ``requests`` artifact) and needs neither the task nor its dataset; a
generation task (``generate_until``) likewise, with each document and the task's scoring (``lm_eval_generations``),
once the carried scoring gives every document's baseline answer the score lm_eval gave it in the run. Otherwise the
script reads the task's dataset, and its header says why. A case failed on drift alone (its limits are kvdiag's own
calibrated measure) has one on the builtin engine: both engines' whole distributions, held to those limits
(``sweep/drift_repro.py``); none on vLLM."""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.checks.accuracy.harness.lm_eval_generations import SCORING

SCORES = ("regression", "collapse")  # the findings a score regression gives (checks/sweep/verdicts.py)
MOST = 200  # documents a script carries at the most: those the dtype lost first


def script(case, run) -> str | None:
    """The script's text, or None where this case has none."""
    from kvdiag.checks.accuracy.harness.lm_eval_options import CHAT_TEMPLATE_DEFAULT
    from kvdiag.proof.fill import filled
    from kvdiag.tasks import TASKS_DIR

    found = next((f for f in case.findings if f.kind in SCORES and f.evidence.get("task")), None)
    base = next((c for c in run.cases if c.params.get("role") == "baseline" and (c.engine, c.model) ==
                 (case.engine, case.model)), None)
    if case.status == "fail" and found is None and any(f.kind == "drift" and f.severity == "error" for f in
                                                       case.findings):
        from kvdiag.checks.sweep.drift_repro import script as drift_script

        return drift_script(case, base)
    if case.status != "fail" or found is None or base is None or \
            (case.metrics.get("replay") or {}).get("engine") != "vllm" or not base.metrics.get("replay"):
        return None
    task, metric = found.evidence["task"], found.evidence["metric"]
    a, b = (_values(run, rec, task, metric) for rec in (base, case))
    hib = case.metrics["scores"][task][metric].get("higher_is_better", True)
    sign = 1 if hib else -1
    changed = sorted((d for d in a if d in b and a[d] != b[d]), key=lambda d: -sign * (a[d] - b[d]))[:MOST]
    if not changed:
        return None
    p = case.params
    seed, template = p.get("seed", 0), p.get("apply_chat_template")
    settings = {"num_fewshot": p.get("num_fewshot"), "random_seed": seed, "numpy_random_seed": seed,
                "torch_random_seed": seed, "fewshot_random_seed": seed,
                "apply_chat_template": {None: False, CHAT_TEMPLATE_DEFAULT: True}.get(template, template),
                "fewshot_as_multiturn": bool(p.get("fewshot_as_multiturn")),
                "system_instruction": p.get("system_instruction"), "gen_kwargs": p.get("gen_kwargs") or None}
    where, why = _inline(run, base, task, metric, {d: a[d] for d in changed})
    if why:
        where = {"include_path": [str(TASKS_DIR), *map(str, p.get("include_paths") or ())],
                 "include_defaults": bool(p.get("include_defaults")), "lm_eval": settings}
    if "generation" in where:
        where["generation"]["seed"] = seed
    return filled("lm_eval_docs_script.py", note=why and f"Reads the task's dataset: {why}.", case={
        "title": f"{case.id}: {task} {metric}, kv_cache_dtype={case.kv_dtype!r} against {base.kv_dtype!r}",
        "kvdiag_saw": found.message, "task": task, "metric": metric, "higher_is_better": hib,
        "documents": {d: [a[d], b[d]] for d in changed},
        "engines": [{"kv_dtype": base.kv_dtype, **base.metrics["replay"]},
                    {"kv_dtype": case.kv_dtype, **case.metrics["replay"]}], **where})


INLINE = {"multiple_choice": ("acc", "acc_norm"), "loglikelihood": ("acc",)}  # the metrics the script computes


def _inline(run, base, task: str, metric: str, docs: dict) -> tuple[dict, str | None]:
    """(``{"requests": {doc id: lm_eval's requests of it}}``, with ``"generation"``: the task's scoring, for a
    generation task; None) where the script can score every document of ``docs`` ({doc id: the baseline's value})
    from what it carries, without the task or its dataset; else ({}, why not: the script reads the task's
    documents). The requests are the baseline's ``requests`` artifact: the same for every dtype."""
    import gzip

    name = (base.metrics.get("artifacts") or {}).get("requests")
    path = Path(run.run_dir) / "artifacts" / name if name else None
    if path is None or not path.exists():
        return {}, "kvdiag kept no requests of the baseline's documents"
    with gzip.open(path, "rt") as f:
        kept = json.load(f)
    got = kept.get(task) or {}
    if not all(d in got for d in docs):
        return {}, f"kvdiag kept no requests of {task}'s documents (a kind of task it keeps none of)"
    kinds = {got[d]["type"] for d in docs}
    if kinds == {"generate_until"}:
        return _generation(((kept.get(SCORING) or {}).get(task)) or {}, metric, {d: got[d] for d in docs}, docs)
    if not all(metric in INLINE.get(got[d]["type"], ()) for d in docs):
        return {}, f"the script computes no {metric} of a {'/'.join(sorted(kinds))} task"
    return {"requests": {d: got[d] for d in docs}}, None


def _generation(scoring: dict, metric: str, requests: dict, expected: dict) -> tuple[dict, str | None]:
    """A generation task's documents inline (``_inline``) once the script's own scoring (lm_eval's task built from
    the carried config over these documents) gives each one's baseline answer the value lm_eval gave it in the run;
    else why not."""
    import logging

    from kvdiag.errors import first_line
    from kvdiag.proof.lm_eval_docs_script import scored, task_of

    if "config" not in scoring:
        return {}, f"its scoring cannot be carried: {scoring.get('refused', 'kvdiag kept none')}"
    docs = {d: r["doc"] for d, r in requests.items()}
    quiet = logging.getLogger("lm_eval")  # its notes on a task config built in memory: none for the user to act on
    level, quiet.level = quiet.level, logging.ERROR
    try:
        got = scored(task_of(scoring, list(docs.values())), metric, docs, {d: r["response"] for d, r in
                                                                             requests.items()})
    except Exception as e:  # noqa: BLE001 - the task's own code, run on a config built in memory
        return {}, f"lm_eval cannot score it from the carried config ({type(e).__name__}: {first_line(e)[:200]})"
    finally:
        quiet.setLevel(level)
    wrong = next((d for d in docs if got.get(d) != expected[d]), None)
    if wrong is not None:
        return {}, (f"the carried scoring gives document {wrong}'s baseline answer {got.get(wrong)}, lm_eval in the "
                    f"run {expected[wrong]:g}")
    keep = ("type", "arguments", "doc", "target")
    return {"requests": {d: {k: r[k] for k in keep} for d, r in requests.items()},
            "generation": {k: v for k, v in scoring.items() if k != "refused"}}, None


def _values(run, rec, task: str, metric: str) -> dict:
    """{doc id: value} of ``metric`` in ``task`` as ``rec``'s lm_eval scored it."""
    name = (rec.metrics.get("artifacts") or {}).get("samples")
    path = Path(run.run_dir) / "artifacts" / name if name else None
    if path is None or not path.exists():
        return {}
    return {d: v for d, v in json.loads(path.read_text()).get(task, {}).get(metric, {}).items()
            if isinstance(v, (int, float))}
