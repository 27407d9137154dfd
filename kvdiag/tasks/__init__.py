"""lm_eval tasks shipped with kvdiag: ``kv_recall`` and ``kv_recall_long`` (tag ``kvdiag``).

Data: ``data/*.jsonl``, written by ``scripts/make_tasks.py``; format: ``recall.py``.
"""

from __future__ import annotations

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
DEFAULT_TASKS = ["kv_recall", "kv_recall_long"]


def task_manager(include_paths=(), include_defaults: bool = True, metadata: dict | None = None):
    """An ``lm_eval`` TaskManager that knows kvdiag's tasks plus any ``include_paths``.

    ``include_defaults=False`` leaves out lm_eval's own ~10k task configs (indexing
    them takes ~10 s), for when only kvdiag's tasks are needed. ``metadata`` reaches every task's config (as
    lm_eval's --metadata).
    """
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + [str(p) for p in include_paths]
    return TaskManager(include_path=paths, include_defaults=include_defaults, metadata=metadata)
