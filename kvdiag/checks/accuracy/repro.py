"""The reproducer of an accuracy score regression (``kvdiag.proof``: a ``regression`` or ``collapse`` row), on an
engine that says how it was started (``protocol.Replayable``; vLLM): the documents whose score changed between the
baseline dtype and the dtype (kvdiag's per-document results, ``artifacts/*.samples.json``), scored again by lm_eval's
vLLM backend with each dtype's engine arguments and the run's lm_eval settings (``lm_eval_docs_script.py``). Where the
task is scored by loglikelihood (multiple choice: ``acc``, ``acc_norm``), the script carries each document's requests
inline as lm_eval made them (the baseline's ``requests`` artifact) and needs neither the task nor its dataset. A case
failed on drift alone has none: its limits are kvdiag's own calibrated measure."""

from __future__ import annotations

import json
from pathlib import Path

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
    inline = _inline(run, base, task, metric, changed)
    where = {"requests": inline} if inline else {
        "include_path": [str(TASKS_DIR), *map(str, p.get("include_paths") or ())],
        "include_defaults": bool(p.get("include_defaults")), "lm_eval": settings}
    return filled("lm_eval_docs_script.py", {
        "title": f"{case.id}: {task} {metric}, kv_cache_dtype={case.kv_dtype!r} against {base.kv_dtype!r}",
        "kvdiag_saw": found.message, "task": task, "metric": metric, "higher_is_better": hib,
        "documents": {d: [a[d], b[d]] for d in changed},
        "engines": [{"kv_dtype": base.kv_dtype, **base.metrics["replay"]},
                    {"kv_dtype": case.kv_dtype, **case.metrics["replay"]}], **where})


INLINE = {"multiple_choice": ("acc", "acc_norm"), "loglikelihood": ("acc",)}  # the metrics the script computes


def _inline(run, base, task: str, metric: str, docs: list[str]) -> dict | None:
    """{doc id: lm_eval's requests of it} (the baseline's ``requests`` artifact: the same for every dtype) where the
    script can score every document of ``docs`` by its requests alone, without the task or its dataset; else
    None (the script reads the task's documents)."""
    import gzip

    name = (base.metrics.get("artifacts") or {}).get("requests")
    path = Path(run.run_dir) / "artifacts" / name if name else None
    if path is None or not path.exists():
        return None
    with gzip.open(path, "rt") as f:
        got = json.load(f).get(task) or {}
    if not all(d in got and metric in INLINE.get(got[d]["type"], ()) for d in docs):
        return None
    return {d: got[d] for d in docs}


def _values(run, rec, task: str, metric: str) -> dict:
    """{doc id: value} of ``metric`` in ``task`` as ``rec``'s lm_eval scored it."""
    name = (rec.metrics.get("artifacts") or {}).get("samples")
    path = Path(run.run_dir) / "artifacts" / name if name else None
    if path is None or not path.exists():
        return {}
    return {d: v for d, v in json.loads(path.read_text()).get(task, {}).get(metric, {}).items()
            if isinstance(v, (int, float))}
