"""Dataset loader for kvdiag's lm_eval tasks (referenced by the YAML as ``!function kv_utils.load_json``).

lm_eval hands ``dataset_kwargs`` to this function. ``data_files`` paths that are
relative are taken relative to this folder, not to the current directory, so
the tasks work wherever lm_eval is started from. Self-contained on purpose:
lm_eval imports it by file path, outside the ``kvdiag`` package.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def _resolve(files):
    if isinstance(files, dict):
        return {split: _resolve(f) for split, f in files.items()}
    if isinstance(files, (list, tuple)):
        return [_resolve(f) for f in files]
    path = Path(files)
    return str(path if path.is_absolute() else HERE / path)


def load_json(data_files=None, **_metadata):
    """A DatasetDict of the JSON-lines files, one split per key, rows in file order. Built in memory
    (``datasets.load_dataset("json")`` would also write an Arrow cache, several times slower)."""
    import json

    import datasets

    files = _resolve(data_files)
    files = files if isinstance(files, dict) else {"train": files}
    splits = {}
    for split, paths in files.items():
        rows = []
        for path in [paths] if isinstance(paths, str) else paths:
            with open(path, encoding="utf-8") as f:
                rows += [json.loads(line) for line in f if line.strip()]
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


def load_needle(needle_lengths=None, max_model_len=None, needle_per_cell=None, **_metadata):
    """kv_needle's grid (kvdiag.tasks.needle), made for the lengths its metadata names: ``needle_lengths`` (kvdiag
    accuracy puts its resolved grid there), else those of ``max_model_len`` (an engine argument) or 2048."""
    import datasets

    from kvdiag.tasks import needle

    lengths = needle_lengths or needle.default_lengths(int(max_model_len or 2048))
    docs = needle.documents([int(n) for n in lengths], per_cell=int(needle_per_cell or needle.PER_CELL))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
