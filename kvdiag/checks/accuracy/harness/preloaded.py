"""The run's lm_eval tasks, loaded once by the workers' fork server (kvdiag.run.runner) for every accuracy worker
forked from it: the fork server imports this module with ``KVDIAG_PRELOAD_TASKS`` in its environment (what
``env_for`` gives), loads those tasks (from the Hugging Face cache: kvdiag's own process loaded them first, as its
check of the inputs), and each worker takes them once (``take``) instead of loading them again. A failure here is
kept quiet: the worker then loads the tasks itself and reports what goes wrong.
"""

from __future__ import annotations

import json
import os

ENV = "KVDIAG_PRELOAD_TASKS"
_LOADED: dict = {}


def key(tasks, include_paths=(), include_defaults: bool = False, metadata=None) -> str:
    """What identifies a task load: the names, the folders, lm_eval's own index or not, the metadata."""
    return json.dumps([list(tasks), [str(p) for p in include_paths or ()], bool(include_defaults),
                       metadata or None], sort_keys=True, default=str)


def env_for(cases: list) -> dict:
    """``{ENV: key}`` of the accuracy cases' tasks (they all run the same ones), for the fork server's environment."""
    p = next((c.params for c in cases if c.check == "accuracy" and c.params.get("tasks")), None)
    if p is None:
        return {}
    return {ENV: key(p["tasks"], p.get("include_paths"), p.get("include_defaults"), p.get("metadata"))}


def take(k: str):
    """The tasks loaded for ``k`` (lm_eval's TaskManager.load result), once; None when not preloaded here."""
    return _LOADED.pop(k, None)


def _load(k: str) -> None:
    from kvdiag.tasks import task_manager

    tasks, include_paths, include_defaults, metadata = json.loads(k)
    try:
        _LOADED[k] = task_manager(tuple(include_paths), include_defaults, metadata or None).load(list(tasks))
    except Exception:  # noqa: BLE001 - the worker loads them itself and says what failed
        pass


if os.environ.get(ENV):
    _load(os.environ[ENV])
