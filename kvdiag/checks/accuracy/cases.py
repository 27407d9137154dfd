"""The accuracy sweep's cases: one per kv dtype, the baseline first, with the lm_eval tasks resolved before any
worker starts."""

from __future__ import annotations

from pathlib import Path

from kvdiag.checks.cases import Target, resolve_sweep, sweep_cases


def cases(target: Target, p) -> tuple:
    """(cases, analyze) of ``kvdiag accuracy`` with AccuracyParams ``p``: one case per dtype, the baseline first,
    and the analysis that judges them against it."""
    from kvdiag.checks.accuracy.harness.lm_eval_options import lm_eval_params
    from kvdiag.checks.accuracy.needle_cases import needle_params
    from kvdiag.checks.accuracy.verdict import analyze
    from kvdiag.tasks import CONVERSATION_TASKS, SHIPPED_TASKS

    sweep = resolve_sweep(target, p.baseline)
    task_names, need_defaults = _tasks(p.tasks, p.include_paths)
    params = {"tasks": task_names, "include_paths": [str(x) for x in p.include_paths or ()],
              "include_defaults": need_defaults, "limit": _limit(p.limit), "num_fewshot": p.num_fewshot, "seed": p.seed,
              **lm_eval_params(p, sweep.model, sweep.spec["engine_args"])}
    params.update(needle_params(p, sweep, task_names, params["metadata"]))
    if p.drift_decoded:  # each dtype's worker scores its decoded continuations under the baseline dtype too
        params.update(drift_decoded=p.drift_decoded, baseline=sweep.baseline)
    if set(task_names) & set(CONVERSATION_TASKS):  # each turn reads the turns before back from the prefix cache
        params["prefix_caching"] = True
    if need_defaults or p.include_paths or set(task_names) - set(SHIPPED_TASKS):  # not only kvdiag's own tasks
        from kvdiag.checks.accuracy.harness.lm_eval_adapter import check_tasks_load

        check_tasks_load(task_names, tuple(params["include_paths"]), need_defaults, params.get("metadata"))
    cases = sweep_cases("accuracy", sweep, params, target.isolate)
    return cases, lambda run: analyze(run, baseline=sweep.baseline, max_drop=p.max_drop, alpha=p.alpha,
                                      max_kl=p.max_kl, min_top1=p.min_top1, strict=p.strict)


def _tasks(tasks, include_path) -> tuple[list[str], bool]:
    from kvdiag.errors import UserError
    from kvdiag.tasks import DEFAULT_TASKS, SHIPPED_TASKS

    for p in include_path or ():
        if not Path(p).is_dir():
            raise UserError(f"--include-path '{p}' is not a folder")
    names = [n.strip() for t in tasks or () for n in t.split(",") if n.strip()] or list(DEFAULT_TASKS)
    if not include_path and set(names) <= set(SHIPPED_TASKS):  # kvdiag's own tasks: known without lm_eval's
        return list(dict.fromkeys(names)), False  # task index (importing it costs the run ~1.6 s before any worker)
    from kvdiag.checks.accuracy.harness.lm_eval_adapter import resolve_tasks

    return resolve_tasks(names, tuple(str(p) for p in include_path or ()))


def _limit(limit: float | None):
    """lm_eval's limit: a number of documents per task (>= 1, whole), or a fraction of each task (0 < limit < 1)."""
    from kvdiag.errors import UserError

    if limit is None:
        return None
    if not 0 < limit < 1 and not (limit >= 1 and float(limit).is_integer()):
        raise UserError(f"--limit {limit:g}: give a number of documents per task (1, 2, ...) or a fraction of "
                        "each task between 0 and 1")
    return int(limit) if limit >= 1 else limit
