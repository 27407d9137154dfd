"""No dead code in kvdiag/: vulture finds no unused name (tests/vulture_whitelist.py lists the names
used in ways vulture cannot see, each with its user). vulture comes with the test extra (pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_vulture_finds_no_dead_code():
    cmd = [sys.executable, "-m", "vulture", "kvdiag", "tests/vulture_whitelist.py", "--min-confidence", "60",
           "--exclude", "kvdiag/assets"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 3), out.stderr  # 3: vulture found dead code
    findings = out.stdout.strip()
    assert not findings, "dead code (delete it, or whitelist a real false positive in tests/vulture_whitelist.py " \
                         "with its user):\n" + findings
