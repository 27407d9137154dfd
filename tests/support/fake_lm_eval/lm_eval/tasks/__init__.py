class TaskManager:
    def __init__(self, include_path=None, include_defaults=True):
        self.include_path, self.include_defaults = include_path, include_defaults
