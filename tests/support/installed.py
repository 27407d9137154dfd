"""kvdiag as users install it: a wheel built from this checkout, installed (not editable) into a fresh virtual
environment that sees the packages of the Python running the tests (torch, vLLM, lm_eval) but not the checkout, in
whatever environment that Python is (a venv, conda, the system's). Tests that run kvdiag through :class:`Installed`
test the package that ships, not the source tree."""

from __future__ import annotations

import os
import site
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
    venv.EnvBuilder(with_pip=False).create(prefix)
    outer_packages(prefix)
    # without PYTHONPATH: a checkout on it (its build's kvdiag.egg-info) is an installed kvdiag to the new venv's
    # pip, which then installs nothing ("already installed with the same version")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(prefix / "bin" / "python"), "install", "-q",
                    "--no-deps", "--disable-pip-version-check", str(wheel)], check=True, capture_output=True,
                   timeout=600, env=env)
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return Installed(wheel, prefix, cwd)


def outer_packages(prefix: Path) -> Path:
    """A ``.pth`` in the new venv naming this Python's site directories, so the wheel's kvdiag runs on this Python's
    torch and vLLM. Not ``system_site_packages``: inside a venv that is the *base* interpreter's packages, not the
    venv's. The directories are plain lines, so their own ``.pth`` files (the editable kvdiag's finder) never run,
    and they come after the venv's own site-packages, so the wheel's kvdiag is the one imported."""
    dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    dirs = [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]  # a venv inside the checkout too (.ci/run's)
    (own,) = (prefix / "lib").glob("python*/site-packages")
    pth = own / "_kvdiag_tests_outer.pth"
    pth.write_text("".join(f"{d}\n" for d in dirs))
    return pth
