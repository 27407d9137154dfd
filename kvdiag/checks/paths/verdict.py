"""The paths check's verdicts: a path's distance from the cold run, judged against the floor (``floor.judge``), and
whether the path was taken at all (its counter). A path that ran in the engine of its own cold runs is judged in its
worker (``verdict``); one that ran in an engine of its own is judged here in the parent, against its reference case
of the same kv dtype (``analyze``, again on ``--resume``)."""

from __future__ import annotations

# the findings analyze() adds: dropped before it judges again (--resume)
ANALYSIS_KINDS = ("divergence", "near_tie", "logprob_drift", "nan_output", "not_taken", "not_counted",
                  "no_reference", "graph_mode", "own_floor", "batch_invariance")


def verdict(case, p, path, config, floor, trial, env: dict):
    rec = case.result("pass", environment=env, metrics={
        "path": path.name, "role": "own", "counter": path.counter, "counted": trial.counted,
        "path_config": {"spec": config.spec, "args": config.args}, **trial.notes})
    judge_into(rec, p, path, floor, trial.reference, trial.out, trial)
    return rec


def judge_into(rec, p, path, floor, reference, out, trial) -> None:
    """Fill ``rec``'s metrics, findings and status from ``out`` against ``reference`` and the floor."""
    from kvdiag.checks.paths.floor import distance

    d = distance(reference, out)
    for x in d.divergences if trial.notes.get("cuts") else ():  # one request a (prompt, position) cut: name those
        x.request, x.position = trial.notes["cuts"][x.request]
    for x in d.divergences if trial.notes.get("labels") else ():  # requests of several batch layouts: say which
        x.request = trial.notes["labels"][x.request]
    rec.metrics.update(_judged(rec, p, floor, d, path.name))
    _taken(rec, path, trial)
    rec.status = "fail" if any(f.severity == "error" for f in rec.findings) else "pass"


def judge_also(rec, p, path, label: str, floor, share_of, reference, out, requests) -> None:
    """A second comparison of the path in ``rec`` (the sliding window's batch against each prompt alone), judged by
    the share of positions it moved against ``share_of`` (``floor.judge``); near-ties by ``floor``. Its numbers go
    under ``metrics[label]``, its findings say ``label``. ``requests``: (request, first position) of each compared
    completion, to name a divergence."""
    from kvdiag.checks.paths.floor import distance

    d = distance(reference, out)
    for x in d.divergences:
        x.request, x.position = requests[x.request][0], requests[x.request][1] + x.position
    rec.metrics[label] = _judged(rec, p, floor, d, f"{path.name}, {label}", share_of)
    if any(f.severity == "error" for f in rec.findings):
        rec.status = "fail"


def _judged(rec, p, floor, d, said: str, share_of=None) -> dict:
    """Add to ``rec`` the findings of distance ``d`` held to ``floor`` (``floor.judge``), each message after
    ``said``; returns the comparison's metrics."""
    from kvdiag.checks.paths.floor import judge, zero_floor

    measured, logprob_tol, factor = share_of or floor, p.logprob_tol, p.floor_factor
    if p.batch_invariant:  # the floor must be 0, and any difference is the path's (floor.zero_floor)
        floor, broken = zero_floor(measured)
        share_of, logprob_tol, factor = None, 0.0, 1.0
        if broken and not any(f.kind == "batch_invariance" for f in rec.findings):
            rec.add("warning", "batch_invariance", broken)
    tol = floor.tolerance(logprob_tol, factor)
    for severity, kind, message in judge(d, floor, logprob_tol, factor, share_of):
        rec.add(severity, kind, f"{said}: {message}")
    return {"floor": vars(measured), "tolerance": tol, **d.metrics(tol)}


STORE = "a fresh engine of the same arguments (kv-connector's store)"  # the floor part its storing engine sets


def analyze(run, p) -> None:
    """Judge every path case that ran in an engine of its own against its reference case."""
    from kvdiag.checks.paths import completions, layouts
    from kvdiag.checks.paths.catalogue import PATHS
    from kvdiag.checks.paths.floor import Floor, distance

    refs = {(c.engine, c.model, c.kv_dtype, c.metrics.get("path")): c for c in run.cases
            if c.metrics.get("role") == "reference"}
    for rec in run.cases:
        m = rec.metrics
        if m.get("role") != "path" or "completions" not in m:
            continue
        rec.findings = [f for f in rec.findings if f.kind not in ANALYSIS_KINDS]
        path = PATHS[m["path"]]
        ref = refs.get((rec.engine, rec.model, rec.kv_dtype, path.reference))
        if ref is None or ref.status != "pass" or "completions" not in ref.metrics:
            said = "not in this run" if ref is None else f"{ref.status}"
            rec.status = "error"
            rec.add("error", "no_reference", f"{path.name}: its reference case '{path.reference}' of {rec.kv_dtype} "
                    f"is {said}: nothing to hold the path to")
        else:
            floor = Floor(**ref.metrics["floor"])
            if m.get("recompute_floor"):  # a recompute at the path's own preemption points (engine_runs.py)
                floor.merge(Floor(**m["recompute_floor"]))
            if m.get("store_completions"):  # kv-connector: the storing engine, fresh, computed every token
                floor.add(distance(completions.from_json(ref.metrics["completions"]),
                                   completions.from_json(m["store_completions"])), STORE)
            held, out, labels = layouts.pair(ref.metrics, m) if path.own_floor else (
                completions.from_json(ref.metrics["completions"]), completions.from_json(m["completions"]), None)
            if m.get("own_floor") and Floor(**m["own_floor"]).max_dlogprob > p.floor_factor * max(
                    floor.max_dlogprob, p.logprob_tol):  # said; each layout is held to the reference's same one
                rec.add("info", "own_floor", f"{path.name}: its engine's own runs in other batches differ by "
                        f"{m['own_floor']['max_dlogprob']:.3g}, the reference engine's by {floor.max_dlogprob:.3g}: "
                        f"each batch layout is held to the reference's same layout ({len(held)} requests)")
            judge_into(rec, p, path, floor, held, out, _Counted(m.get("counted"), {**m, "labels": labels}))
            _graph(rec, path, ref)


class _Counted:
    """What ``_taken`` reads of a trial, from a record."""

    def __init__(self, counted, notes):
        self.counted, self.notes = counted, notes


def _graph(rec, path, ref) -> None:
    """A graph path whose engine ran another CUDA-graph mode than asked (or the same as its reference) tested
    nothing."""
    asked = (rec.metrics.get("path_config") or {}).get("args", {}).get("compilation_config", {})
    ran, base = rec.metrics.get("cudagraph_mode"), ref.metrics.get("cudagraph_mode")
    if not isinstance(asked, dict) or ran is None or "cudagraph_mode" not in asked:
        return
    if str(ran).upper() != str(asked["cudagraph_mode"]).upper() or ran == base:
        rec.add("warning", "graph_mode", f"{path.name}: the engine ran cudagraph_mode {ran} (asked "
                f"{asked['cudagraph_mode']}, reference {base}): the path was not taken as asked")


def _taken(rec, path, trial) -> None:
    """Whether the path ran: its counter grew (prefix-reset: stayed at 0, and the reset was done)."""
    if path.name == "prefix-reset":
        if trial.notes.get("reset") is False:
            rec.add("error", "reset_refused", "prefix-reset: reset_prefix_cache() returned False with no request "
                    "running")
        if trial.counted:
            rec.add("error", "reset_not_cold", f"prefix-reset: {trial.counted} prompt tokens were read from the "
                    "prefix cache after reset_prefix_cache()")
        return
    if path.name == "offload" and trial.notes.get("reset") is False:  # hits may then come from the device's cache
        rec.add("warning", "reset_refused", "offload: reset_prefix_cache() returned False after the store: the "
                "device prefix cache was not dropped, so the second run may not have read the offloaded copy")
    if path.counter is None:
        return
    if trial.counted is None:
        rec.add("info", "not_counted", f"{path.name}: the engine does not count {path.counter}: whether the path "
                "was taken is not known")
    elif trial.counted <= 0:
        rec.add("warning", "not_taken", f"{path.name}: {path.counter} stayed at 0: the path was not taken, nothing "
                "was tested")
