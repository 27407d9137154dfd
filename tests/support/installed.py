"""kvdiag as users install it: a wheel built from this checkout, installed (not editable) into a fresh virtual
environment that sees this Python's packages (torch, vLLM, lm_eval) but not the checkout. Tests that run kvdiag
through :class:`Installed` test the package that ships, not the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Installed:
    wheel: Path
    prefix: Path  # the virtual environment
    cwd: Path  # a folder outside the checkout, so that nothing imports from it

    @property
    def python(self) -> str:
        return str(self.prefix / "bin" / "python")

    @property
    def kvdiag(self) -> str:
        return str(self.prefix / "bin" / "kvdiag")

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def run(self, *args: str, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
        """``kvdiag ARGS`` from the installed console script."""
        return subprocess.run([self.kvdiag, *args], capture_output=True, text=True, cwd=self.cwd,
                              env={**self.env(), **env}, timeout=timeout)


def build(tmp: Path) -> Installed:
    """Build the wheel (pip, no network: the setuptools the test extra installs) and install it into ``tmp/venv``."""
    import fcntl
    import tempfile

    dist = tmp / "dist"
    # one build at a time: setuptools builds in the checkout's build/ and *.egg-info, and two pytest-xdist workers
    # building at once broke each other's wheel (a CI run: "Failed building wheel for kvdiag", 9 errors)
    with open(Path(tempfile.gettempdir()) / "kvdiag-wheel-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(dist), str(ROOT)], check=True, capture_output=True,
                       timeout=600)
    (wheel,) = dist.glob("kvdiag-*.whl")
    prefix = tmp / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(prefix)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(prefix / "bin" / "python"), "install", "-q",
                    "--no-deps", "--disable-pip-version-check", str(wheel)], check=True, capture_output=True,
                   timeout=600)
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return Installed(wheel, prefix, cwd)
