"""Install a one-module plug-in package the way a third-party distribution would: the module, and a dist-info with
its entry point, in a folder that goes on PYTHONPATH (tests/test_check_plugin.py, tests/test_engine_plugin.py)."""

from __future__ import annotations

import os
from pathlib import Path


def install(root: Path, module: str, source: str, group: str, entry: str) -> dict:
    """Write ``module.py`` and its dist-info (entry point ``entry`` in ``group``) into ``root``; the environment
    (os.environ with ``root`` first on PYTHONPATH) under which kvdiag finds it."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{entry}\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
