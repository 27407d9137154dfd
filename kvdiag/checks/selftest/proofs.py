"""``kvdiag selftest --prove``: the self-test proves the proofs. For each fault caught by a check that writes
reproducers (memleak, paths, wake-cycle, poison and dtypes, on vLLM and on the builtin engine), the script of its
failing case runs twice outside kvdiag: with the fault's patch in the script's engine processes, where it must
reproduce (exit 1), and without it, where it must not (exit 0); else the self-test fails. Each run's output's tail is
kept (``patched_output``, ``output``). A fault the engine cannot patch into a plain process (its traits'
``fault_patch``), or whose check writes no reproducer for what it caught (a finding no plain script shows, an engine
start kvdiag could not record, an engine the check writes none for), is not proved: its row says why
(``unproved``)."""

from __future__ import annotations

from kvdiag.checks.selftest import CAUGHT, jobs_of


def prove_faults(run, engine: str, say=None, jobs: int = 1, timeout: float = 900.0) -> None:
    """Fill each provable fault row of ``run.analysis["selftest"]`` with its ``proof``, and the self-test's ``ok``."""
    from concurrent.futures import ThreadPoolExecutor

    from kvdiag.engines.base import engine_traits
    from kvdiag.proof.runs import attempts, patched_env, write_script

    a = run.analysis.get("selftest")
    if not a:
        return
    traits = engine_traits(engine)
    todo = []
    for row in a["faults"]:
        if row["status"] != CAUGHT:
            continue
        if traits.fault_patch([row["fault"]], "auto") is None:
            row["unproved"] = f"engine {engine} cannot put its faults into a plain script's engine"
            continue
        found = _script(run, row)
        if found is None:
            row["unproved"] = _why_not(row)
            continue
        patch = traits.fault_patch([row["fault"]], found[0].kv_dtype)
        todo.append((row, write_script(run.run_dir, found[0].id, found[1]), patch))
    if say and todo:
        say(f"proving {len(todo)} caught fault(s) without kvdiag: each reproducer with the fault's patch, then "
            f"without it ({jobs} at once)")

    def prove(item) -> None:
        row, script, patch = item
        (patched, said, _), = attempts(script, timeout, env=patched_env(script.with_suffix(".patch"), patch),
                                       tries=1)
        (plain, out, _), = attempts(script, timeout, tries=1)
        row["proof"] = {"script": str(script), "patched": patched, "plain": plain, "ok": patched == 1 and plain == 0,
                        "output": "\n".join(out.splitlines()[-10:]),
                        "patched_output": "\n".join(said.splitlines()[-10:])}
        if say:
            say(f"  {row['fault']}: with its patch exit {patched}, without exit {plain}: "
                + ("proved" if row["proof"]["ok"] else "NOT proved"))

    with ThreadPoolExecutor(max(1, min(jobs, len(todo) or 1))) as pool:
        list(pool.map(prove, todo))
    a["ok"] = a["ok"] and all(r["proof"]["ok"] for r in a["faults"] if "proof" in r)


def _why_not(row: dict) -> str:
    """Why a caught fault has no reproducer to prove, in a line."""
    from kvdiag.checks.registry import get

    check = get(row["intended"])
    if check is not None and not check.reproducer:
        return (f"{row['intended']} writes reproducers only for a failure inside the engine (a crash, a restart "
                "that fails); what it caught here is judged on kvdiag's own measurements of the process")
    return (f"its failing {row['intended']} case has no reproducer (a finding a plain script does not show, an "
            "engine start kvdiag could not record, or an engine the check writes none for)")


def _script(run, row: dict):
    """(the failing case, its reproducer's text) of the fault's intended check, or None."""
    from kvdiag.checks.registry import get
    from kvdiag.results import RunRecord

    check = get(row["intended"])
    if check is None or not check.reproducer:
        return None
    recs = jobs_of(run.cases).get((row["fault"], row["intended"]), [])
    sub = RunRecord(command=run.command, started=run.started, cases=recs, environment={}, run_dir=run.run_dir)
    for rec in recs:
        text = check.reproducer(rec, sub) if rec.status in ("fail", "crashed") else None
        if text:
            return rec, text
    return None
