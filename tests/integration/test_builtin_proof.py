"""The builtin engine's failures come with a proof (issue 66): `kvdiag selftest --prove` writes each failing case's
reproducer, a script that starts the builtin engine through its public API alone, and runs it outside kvdiag, in
fresh processes: with the fault's patch it reproduces (exit 1) and prints the first difference kvdiag recorded,
without it it does not (exit 0). The oracle is the script's own exit code and output, not kvdiag's. One command for a
paths fault (a path held to its own cold run) and the poison fault (the free blocks filled by the script itself)."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

FAULTS = {"paths": "evicted_block_keeps_hash", "poison": "unzeroed_page_reads"}
KVDIAG_SAW = re.compile(r"first differs at generated position (\d+): (\d+)")  # ... instead of N
SCRIPT_SAW = re.compile(r"token (\d+) is (\d+), the reference's (\d+)")


@pytest.fixture(scope="module")
def proved(tmp_path_factory):
    out = tmp_path_factory.mktemp("proof") / "run"
    r = subprocess.run([sys.executable, "-m", "kvdiag", "selftest", "-c", ",".join(FAULTS), "--fault",
                        ",".join(FAULTS.values()), "--prove", "-f", "json", "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout), out


def kvdiag_modules(script: Path) -> set[str]:
    """Every kvdiag or vLLM module the script imports, at any depth."""
    out = set()
    for node in ast.walk(ast.parse(script.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        out |= {n for n in names if n.split(".")[0] in ("kvdiag", "vllm")}
    return out


@pytest.mark.parametrize("check", sorted(FAULTS))
def test_a_builtin_fault_is_proved_by_its_reproducer_with_the_fault_and_not_without(proved, check):
    run, out = proved
    row = next(r for r in run["analysis"]["selftest"]["faults"] if r["fault"] == FAULTS[check])
    proof = row["proof"]
    assert (proof["patched"], proof["plain"], proof["ok"]) == (1, 0, True), proof
    script = Path(proof["script"])
    assert script.parent == out / "repro" and script.name.startswith(check) and script.exists()
    assert kvdiag_modules(script) == {"kvdiag.engines.builtin"}  # the engine's API: no check, runner, CLI or vLLM
    (case,) = [c for c in run["cases"] if c["status"] == "fail" and c["check"] == check]
    finding = next(f["message"] for f in case["findings"] if f["kind"] == "divergence")
    assert "REPRODUCED:" in proof["patched_output"] and "NOT REPRODUCED" in proof["output"]
    position, token = KVDIAG_SAW.search(finding).groups()
    assert (position, token) in {(p, t) for p, t, _ in SCRIPT_SAW.findall(proof["patched_output"])}


@pytest.mark.nightly
def test_selftest_prove_on_the_builtin_engine_proves_every_fault(tmp_path):
    """`kvdiag selftest --prove`, every check (3-4 minutes on 2 cores): each of the builtin engine's 17 faults
    reproduces with its patch and not without (a path or poison divergence, a wake's outputs, a census of what
    survived shutdown, frozen objects and processes left running, a refusal at start, a drift beyond its limits);
    the self-test passes."""
    from kvdiag.engines.builtin.selftest import CATALOGUE

    r = subprocess.run([sys.executable, "-m", "kvdiag", "selftest", "--prove", "-f", "json", "-o", str(tmp_path)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout)["analysis"]["selftest"]["faults"]
    assert {x["fault"] for x in rows if "proof" in x and x["proof"]["ok"]} == set(CATALOGUE.names)
