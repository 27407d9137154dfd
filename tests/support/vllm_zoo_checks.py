"""``kvdiag dtypes --check -e vllm -d auto -m zoo:NAME``, run once per zoo model for every test that reads it: the
zoo tests (vLLM runs the families the builtin engine refuses) and the storage audit's (each layer kind named) ask
for the same command on the same models. tests/conftest.py's session fixture ``vllm_zoo_check`` hands it out and
puts the modules that use it in one pytest-xdist group, so that each model's run happens once."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ZooCheck:
    name: str
    returncode: int
    stdout: str
    stderr: str
    out: Path  # the run directory (-o)
    zoo_dir: Path  # KVDIAG_ZOO_DIR of the run: where a preset without a shipped model is built

    def tail(self) -> str:
        return self.stdout[-3000:] + self.stderr[-3000:]


class ZooChecks:
    """``checks(name)`` -> the :class:`ZooCheck` of zoo model ``name``, run at its first call."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def __call__(self, name: str) -> ZooCheck:
        if name not in self.done:
            zoo_dir, out = self.root / "zoo", self.root / name
            env = {**os.environ, "KVDIAG_ZOO_DIR": str(zoo_dir), "COLUMNS": "300"}
            r = subprocess.run([sys.executable, "-m", "kvdiag", "dtypes", "--check", "-e", "vllm", "-m", f"zoo:{name}",
                                "-d", "auto", "-o", str(out)], capture_output=True, text=True, cwd=ROOT, env=env,
                               timeout=900)
            self.done[name] = ZooCheck(name, r.returncode, r.stdout, r.stderr, out, zoo_dir)
        return self.done[name]
