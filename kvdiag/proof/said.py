"""How a case's proof is said in the terminal, report.md and kvdiag compare: the same words everywhere."""

from __future__ import annotations


def proof_said(proof: dict) -> str:
    """"yes", "yes (1 of 3 runs): intermittent", "no (3 runs)", "not run (exit 2)"."""
    verdict, runs, hits = proof["reproduced"], proof.get("runs", 0), proof.get("hits", 0)
    if verdict == "yes":
        return "yes" if runs <= 1 else f"yes ({hits} of {runs} runs)"
    if verdict == "intermittent":
        return f"yes ({hits} of {runs} runs): intermittent"
    if verdict == "no":
        return f"no ({runs} run{'s' if runs != 1 else ''})"
    code = (proof.get("exit_codes") or [None])[-1]
    return "not run (" + ("timed out" if code is None else f"exit {code}") + ")"


def print_proofs(run, con) -> None:
    """A line per proved case, then its script's command on a line of its own (never broken: it is copied)."""
    from kvdiag.render.fit import with_path

    proved = [c for c in run.cases if c.metrics.get("proof")]
    if not proved:
        return
    con.print("reproduced without kvdiag (each failing case's script, run in a fresh process):")
    for c in proved:
        proof = c.metrics["proof"]
        with_path(con, f"  {c.id}: {proof_said(proof)}:", f"python3 {proof['script']}")
