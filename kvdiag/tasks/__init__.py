"""lm_eval tasks shipped with kvdiag: ``kv_recall`` and ``kv_recall_long`` (tag ``kvdiag``, the default), and the
harder ``kv_recall_p128``, ``kv_recall_p152``, ``kv_recall_p176`` and ``kv_recall_p176_early`` (tag
``kvdiag_hard``: longer than the tiny models were trained on), and ``kv_recall_p450_early``, ``kv_recall_p550_early``
(tag ``kvdiag_long``: 4-6k tokens, for zoo:gemma3 with ``-a max_model_len=8192``), ``kv_needle`` (tag
``kvdiag_needle``): a grid of context length x needle depth made when it loads, up to the engine's window
(``needle.py``), and the conversations ``kv_decode`` and ``kv_multiturn`` (tag ``kvdiag_decode``: generated answers,
run turn by turn by kvdiag's lm_eval model, ``kv_turns.py``).

Data: ``data/*.jsonl``, written by ``scripts/make_tasks.py``; format: ``recall.py``.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
DEFAULT_TASKS = ["kv_recall", "kv_recall_long"]
# known without lm_eval's task index
SHIPPED_TASKS = [*DEFAULT_TASKS, "kv_recall_p128", "kv_recall_p152", "kv_recall_p176", "kv_recall_p176_early",
                 "kv_recall_p450_early", "kv_recall_p550_early", "kv_needle", "kv_decode", "kv_multiturn"]
CONVERSATION_TASKS = ["kv_decode", "kv_multiturn"]  # their engines start with a prefix cache (the turns read it)


def task_manager(include_paths=(), include_defaults: bool = True, metadata: dict | None = None):
    """An ``lm_eval`` TaskManager that knows kvdiag's tasks plus any ``include_paths``.

    ``include_defaults=False`` leaves out lm_eval's own ~15k task configs, for when only kvdiag's tasks are needed.
    With them, their index comes from ``default_index()`` (read from disk after the first time). ``metadata``
    reaches every task's config (as lm_eval's --metadata).
    """
    from lm_eval.tasks import TaskManager

    quiet_metadata_hint()
    paths = [str(TASKS_DIR)] + [str(p) for p in include_paths]
    if not include_defaults:
        return TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    tm = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    try:
        _merge_index(tm, default_index())
    except Exception:  # noqa: BLE001 - another lm_eval's internals: index the slow way
        return TaskManager(include_path=paths, include_defaults=True, metadata=metadata)
    return tm


METADATA_HINT = "Custom kwargs can be passed to `--metadata`"


class _OwnTaskMetadataHint(logging.Filter):
    """Drops lm_eval's warning, at each load of a task whose data comes from a ``custom_dataset`` function, that
    the function takes ``--metadata`` kwargs: kvdiag's own tasks take none, so on every run it only said nothing
    to act on. A user's task keeps it (its function may well want some: kvdiag has --metadata too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return METADATA_HINT not in msg or msg.split(":", 1)[0] not in SHIPPED_TASKS


_METADATA_FILTER = _OwnTaskMetadataHint()


def quiet_metadata_hint() -> None:
    """Install the filter on the logger lm_eval warns with (lm_eval/api/task.py), once per process."""
    logger = logging.getLogger("lm_eval.api.task")
    if _METADATA_FILTER not in logger.filters:
        logger.addFilter(_METADATA_FILTER)


def index_cache() -> Path:
    """Where lm_eval's task index is kept: ``$KVDIAG_CACHE``, else ``$XDG_CACHE_HOME/kvdiag``, else ~/.cache/kvdiag."""
    import os

    return Path(os.environ.get("KVDIAG_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "kvdiag"
                ).expanduser()


@functools.lru_cache(maxsize=1)
def default_index() -> dict:
    """lm_eval's own task index ({name: entry}, ~15k YAML files: 7-17 s to read on 2 cores), read once per installed
    lm_eval and kept in ``index_cache()`` (16 MB; about a second to read back), and once per process (the workers
    forked from the fork server that read it have it; lm_eval deep-copies an entry's config before using it). A
    changed lm_eval (version, or its tasks folder touched) is indexed again."""
    import pickle
    from importlib.metadata import version

    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    root = Path(lm_eval.tasks.__file__).parent
    cache = index_cache() / f"lm_eval-{version('lm_eval')}-{int(root.stat().st_mtime)}-tasks.pkl"
    try:
        return pickle.loads(cache.read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        pass
    index = TaskIndex.build([root])
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
        tmp.replace(cache)
    except OSError:  # a read-only home: index each time
        pass
    return index


def _merge_index(tm, defaults: dict) -> None:
    """lm_eval's TaskManager with ``defaults`` under its own paths' entries (later paths win, as lm_eval merges)."""
    from collections import defaultdict
    from itertools import chain

    from lm_eval.tasks._index import Kind

    index = {**defaults, **tm._index}
    buckets = defaultdict(list)
    for k, e in index.items():
        buckets[e.kind].append(k)
    tm._index = index
    tm._all_tasks = sorted(index)
    tm._all_subtasks = sorted(chain.from_iterable(buckets[k] for k in {Kind.TASK, Kind.PY_TASK}))
    tm._all_groups = sorted(buckets[Kind.GROUP])
    tm._all_tags = sorted(buckets[Kind.TAG])
