import os

if os.environ.get("FAKE_LM_EVAL_NO_TASKS"):  # as where the task folder and its datasets are absent
    raise ImportError("no task folder here")


class TaskManager:
    def __init__(self, include_path=None, include_defaults=True):
        self.include_path, self.include_defaults = include_path, include_defaults
