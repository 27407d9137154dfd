"""lm_eval's request as its backends take it (the fields the reproducer fills)."""

from dataclasses import dataclass, field


@dataclass
class Instance:
    request_type: str
    doc: dict
    arguments: tuple
    idx: int
    metadata: tuple = field(default_factory=lambda: (None, None, None))
