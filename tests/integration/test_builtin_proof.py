"""The builtin engine's failures come with a proof (issue 66): `kvdiag selftest -c paths --prove` writes the failing
path case's reproducer, a script that starts the builtin engine through its public API alone, and runs it outside
kvdiag, in fresh processes: with the fault's patch it reproduces (exit 1) and prints the first difference kvdiag
recorded, without it it does not (exit 0). The oracle is the script's own exit code and output, not kvdiag's."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

KVDIAG_SAW = re.compile(r"request (\S+) first differs at generated position (\d+): (\d+) instead of (\d+)")
SCRIPT_SAW = re.compile(r"request (\S+): token (\d+) is (\d+), the reference's (\d+)")


def kvdiag_modules(script: Path) -> set[str]:
    """Every kvdiag module the script imports, at any depth."""
    out = set()
    for node in ast.walk(ast.parse(script.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        out |= {n for n in names if n.split(".")[0] in ("kvdiag", "vllm")}
    return out


def test_a_builtin_path_fault_is_proved_by_its_reproducer_with_the_fault_and_not_without(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "kvdiag", "selftest", "-c", "paths", "--fault",
                        "evicted_block_keeps_hash", "--prove", "-f", "json", "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = json.loads(r.stdout)
    (row,) = run["analysis"]["selftest"]["faults"]
    proof = row["proof"]
    assert (proof["patched"], proof["plain"], proof["ok"]) == (1, 0, True), proof
    script = Path(proof["script"])
    assert script.parent == out / "repro" and script.exists()
    assert kvdiag_modules(script) == {"kvdiag.engines.builtin"}  # the engine's API: no check, runner, CLI or vLLM
    (case,) = [c for c in run["cases"] if c["status"] == "fail"]
    finding = next(f["message"] for f in case["findings"] if f["kind"] == "divergence")
    assert "REPRODUCED:" in proof["patched_output"] and "NOT REPRODUCED" in proof["output"]
    assert KVDIAG_SAW.search(finding).groups() in SCRIPT_SAW.findall(proof["patched_output"])
