"""Running a reproducer outside kvdiag and recording what it said: each run in a fresh process (up to ``TRIES`` when
it disagrees with kvdiag: vLLM is not always deterministic from one process to the next), the outcome on the case
(``metrics.proof`` and one finding), and the environment that puts a self-test fault's patch into the script's engine
processes."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

TRIES = 3  # runs of a reproducer that disagrees with kvdiag before it is called intermittent or not reproduced
TAIL = 20  # lines of a reproducer's output kept in the case's record (the whole goes to repro/CASE.log)
FINDINGS = ("reproduced", "reproduced_intermittently", "not_reproduced", "proof_not_run")
PROVE_ENV = "KVDIAG_PROVE"  # 0, false, no or off: no proofs where --prove/--no-prove is not given


def prove_default() -> bool:
    """Whether a run proves its failures unless told (``PROVE_ENV``; default yes)."""
    import os

    return os.environ.get(PROVE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def write_script(run_dir, case_id: str, text: str) -> Path:
    """``RUN_DIR/repro/CASE.py`` (the case id made a file name), executable."""
    script = Path(run_dir) / "repro" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", case_id) + ".py")
    script.parent.mkdir(exist_ok=True)
    script.write_text(text)
    script.chmod(0o755)
    return script


def patched_env(where: Path, patch: str) -> dict:
    """The environment of a reproducer run whose engine processes (the script's ``--run N`` children) execute
    ``patch`` first: a ``sitecustomize`` on PYTHONPATH (the self-test's fault, re-introduced outside kvdiag's
    workers). The script's own process is left alone: it only compares."""
    import os

    where.mkdir(parents=True, exist_ok=True)
    body = "".join(f"    {line}\n" for line in patch.splitlines())
    (where / "sitecustomize.py").write_text(f"import sys\n\nif sys.argv[1:2] == ['--run']:\n{body}")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(where) + (os.pathsep + path if path else "")}


def attempts(script: Path, timeout: float, env: dict | None = None,
             tries: int = TRIES) -> list[tuple[int | None, str, float]]:
    """(exit code or None on a timeout, output, seconds) of each run: until one reproduces (exit 1), an engine did
    not run (2), or ``tries`` runs."""
    runs = []
    while len(runs) < tries:
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                               env=env)
            runs.append((p.returncode, p.stdout + p.stderr, time.monotonic() - t0))
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            runs.append((None, out + f"\n(timed out after {timeout:g} s)", time.monotonic() - t0))
        if runs[-1][0] != 0:
            break
    return runs


def record(rec, script: Path, runs: list, strict: bool = False) -> None:
    """The outcome of ``runs`` on ``rec``: ``metrics.proof`` and one finding that says it. ``strict`` (--strict): a
    failure that did not reproduce is an error (it may be kvdiag's own doing), not a warning."""
    codes = [code for code, _, _ in runs]
    hits = codes.count(1)
    counted = [c for c in codes if c in (0, 1)]
    if codes[-1] not in (0, 1):
        verdict = "not run"
    elif hits == len(counted):
        verdict = "yes"
    elif hits:
        verdict = "intermittent"
    else:
        verdict = "no"
    log = script.with_suffix(".log")
    log.write_text("".join(f"=== run {i + 1}: exit {code} in {s:.0f} s\n{out}\n" for i, (code, out, s) in
                           enumerate(runs)))
    rec.metrics["proof"] = {"script": str(script), "reproduced": verdict, "runs": len(counted), "hits": hits,
                            "exit_codes": codes, "seconds": round(sum(s for _, _, s in runs), 1),
                            "output": "\n".join(runs[-1][1].splitlines()[-TAIL:])}
    rec.findings = [f for f in rec.findings if f.kind not in FINDINGS]
    command = f"python3 {script}"
    if verdict == "yes":
        rec.add("info", "reproduced", f"reproduced without kvdiag, in a fresh process: {command} (exit 1"
                + (f", {hits} of {len(counted)} runs" if len(counted) > 1 else "") + ")")
    elif verdict == "intermittent":
        rec.add("warning", "reproduced_intermittently", f"reproduced {hits} of {len(counted)} runs without kvdiag: "
                f"{command}; the failure is intermittent")
    elif verdict == "no":
        rec.add("error" if strict else "warning", "not_reproduced",
                f"did not reproduce without kvdiag in {len(counted)} runs: {command}; "
                "it may come from kvdiag's own use of the engine")
    else:
        why = "timed out" if codes[-1] is None else f"exit {codes[-1]}"
        rec.add("info", "proof_not_run", f"the reproducer did not run its engines ({why}; its output: {log}): "
                f"{command}")
