"""The reproducer of a ``wrong`` dtypes row (``kvdiag.proof``), on an engine that says how it was started
(``protocol.Replayable``; vLLM, or the builtin engine through its public API), from the baseline's start ('auto',
which started) and the row's own:

- refused, though it is the model's own dtype: the baseline's start with this ``kv_cache_dtype``, which must die
  (vLLM: ``crash_script.py``, its command; the builtin engine: ``call_script.py``, its start raising what kvdiag
  saw);
- non-finite logprobs: both engines run the probe's greedy prompts; any NaN/inf of this dtype's reproduces;
- not bit-identical to 'auto' where it stores what 'auto' stores: the same runs, any token or logprob that differs
  reproduces (``paths_script.py`` at tolerance 0).

A row wrong by its drift against its family's limits (KL, top-1 agreement over the drift probe's teacher-forced
distributions): on the builtin engine, both engines' distributions compared as kvdiag does, held to those limits
(``sweep/drift_repro.py``); on vLLM none, which gives no whole distribution of a prompt's tokens."""

from __future__ import annotations

import shlex

SO_FAR = 1e9  # a tolerance no logprob reaches: only non-finite ones count


def script(case, run) -> str | None:
    from kvdiag.checks.sweep import drift
    from kvdiag.proof.fill import filled

    if case.status != "fail" or case.metrics.get("row") != "wrong":
        return None
    base = next((c for c in run.cases if c.params.get("role") == "baseline" and (c.engine, c.model) ==
                 (case.engine, case.model)), None)
    start = (base.metrics.get("replay") or {}) if base is not None else {}
    if start.get("engine") not in ("vllm", "builtin"):  # the engines paths_script.py starts
        return None
    saw = "; ".join(f.message for f in case.findings if f.severity == "error")
    if not case.metrics.get("started"):  # refused (drift.wrongly_refused): the baseline's start with this dtype
        if start["engine"] != "vllm":
            return refused(case, start, saw)
        return filled("crash_script.py", {"title": f"{case.id}: vLLM refuses kv_cache_dtype={case.kv_dtype!r}",
                                          "kvdiag_saw": saw, "command": start_command(start, case.kv_dtype)})
    if case.metrics.get("finite"):
        same = drift.family(case.kv_dtype, base.metrics.get("model_dtype")) == "identical"
        if not same or (case.metrics.get("drift") or {}).get("identical") is not False:
            from kvdiag.checks.sweep.drift_repro import script as drift_script

            return drift_script(case, base)  # wrong by its drift limits
    own = case.metrics.get("replay")
    if not own:
        return None
    tol = 0.0 if case.metrics.get("finite") else SO_FAR
    call = {"prompts": base.metrics["prompts"], "labels": [str(i) for i in range(len(base.metrics["prompts"]))],
            "max_tokens": drift.GREEDY_TOKENS, "reset": True}
    return filled("paths_script.py", {
        "title": f"{case.id}: kv_cache_dtype={case.kv_dtype!r} against 'auto'" +
                 (", bit for bit" if tol == 0 else ", finite logprobs"),
        "kvdiag_saw": saw, "tolerance": tol, "logprobs": 2, "engines": {"reference": start, "path": own},
        "runs": [{"engine": "reference", "steps": [{**call, "as": "reference"}]},
                 {"engine": "path", "steps": [{**call, "as": "path"}]}]}, engine=start["engine"])


def refused(case, start: dict, saw: str) -> str | None:
    """The builtin engine's refusal: its start with the baseline's spec and this ``kv_cache_dtype``, which must raise
    the exception kvdiag saw (the ``unsupported`` finding's); None where kvdiag kept none."""
    from kvdiag.proof.fill import filled

    raised = next((f.evidence.get("exception") for f in case.findings if f.kind == "unsupported"), None)
    if not raised:
        return None
    return filled("call_script.py", {
        "title": f"{case.id}: the engine refuses kv_cache_dtype={case.kv_dtype!r}", "kvdiag_saw": saw,
        "expected": f"the engine starts with kv_cache_dtype={case.kv_dtype!r}, the model's own dtype, as it does with "
                    "'auto'", "raises": raised,
        "engine": {**start, "spec": {**start["spec"], "kv_cache_dtype": case.kv_dtype}}, "calls": []},
        engine=start["engine"])


def start_command(start: dict, kv_dtype: str) -> str:
    """``python3 -c``: vLLM's ``LLM`` with the baseline's arguments and environment, ``kv_cache_dtype`` set."""
    body = (f"import os; os.environ.update({start['env']!r}); from vllm import LLM; "
            f"LLM(**{({**start['llm'], 'kv_cache_dtype': kv_dtype})!r}); print('started')")
    return "python3 -c " + shlex.quote(body)
