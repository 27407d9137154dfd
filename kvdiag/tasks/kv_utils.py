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
    import datasets

    return datasets.load_dataset("json", data_files=_resolve(data_files))
