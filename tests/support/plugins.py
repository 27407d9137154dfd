"""Install a plug-in the way a third-party distribution would: its module (one file, or a package folder), and a
dist-info with its entry point, in a folder that goes on PYTHONPATH (tests/integration/test_check_plugin.py,
tests/integration/test_engine_plugin.py)."""

from __future__ import annotations

import os
from pathlib import Path


def install(root: Path, module: str, source: str | Path, group: str, entry: str) -> dict:
    """Write ``module.py`` (``source``: its text) or copy the package folder ``source`` as ``module/``, and its
    dist-info (entry point ``entry`` in ``group``), into ``root``; the environment (os.environ with ``root`` first on
    PYTHONPATH) under which kvdiag finds it."""
    if isinstance(source, Path):
        import shutil

        shutil.copytree(source, root / module, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        (root / f"{module}.py").write_text(source)
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{entry}\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
