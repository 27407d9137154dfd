"""After a run: write each failing case's reproducer (its check's, or a crash's own command), run it in a fresh
process, and record whether it reproduces (``kvdiag.proof.runs``)."""

from __future__ import annotations

from kvdiag.proof.runs import attempts, record, write_script


def prove_run(run, say=None, timeout: float = 900.0, jobs: int = 1, strict: bool = False) -> None:
    """Prove every failing case of ``run`` whose check writes a reproducer, ``jobs`` at once (the run's own: its
    engines were sized to share the device so); ``say(line)`` tells progress; ``strict``: a failure that does not
    reproduce is an error of its case (``record``)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvdiag.checks.registry import get
    from kvdiag.proof.crash import script as crash_script

    todo = []
    for rec in run.cases:
        check = get(rec.check)
        if rec.status not in ("fail", "crashed") or check is None:
            continue
        text = check.reproducer(rec, run) if check.reproducer else None
        text = text or crash_script(rec)  # a crash inside the engine: its own command, whatever the check
        if text is None:
            continue
        todo.append((rec, write_script(run.run_dir, rec.id, text)))
    if say and todo:
        say(f"proving {len(todo)} failure(s) without kvdiag, each in a fresh process ({jobs} at once)")

    def prove(item) -> None:
        rec, script = item
        record(rec, script, attempts(script, timeout), strict)
        if say:
            said = rec.metrics["proof"]
            say(f"  {rec.id}: reproduced {said['reproduced']} ({said['hits']} of {said['runs']} runs, "
                f"{said['seconds']:.0f} s): python3 {script}")

    with ThreadPoolExecutor(max(1, min(jobs, len(todo) or 1))) as pool:
        list(pool.map(prove, todo))


