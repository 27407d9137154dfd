"""Free-list block allocator with reference counts, per-sequence block tables and slot mapping.

A block table is a plain ``list[int]`` of block ids; position p of a sequence lives in
slot ``table[p // block_size] * block_size + p % block_size``. Fresh blocks are
handed to ``on_fresh`` (the engine zeroes them) before anyone writes to them. The
lowest free id is taken first, so a cache that was emptied is refilled in the same order
(deterministic, and freed blocks are reused at once).
:meth:`fork` shares a table's full blocks and copies its partially filled last block
(copy-on-write for scoring several continuations after one context).
"""

from __future__ import annotations

import heapq
from typing import Callable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, on_fresh: Callable[[list[int]], None] | None = None,
                 on_copy: Callable[[int, int], None] | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.on_fresh, self.on_copy = on_fresh, on_copy
        self.free_ids: list[int] = list(range(num_blocks))  # a heap
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_ids)

    def allocate(self, num_blocks: int, fresh: bool = True) -> list[int]:
        """Take blocks off the free list; ``fresh=False``: the caller overwrites them whole (no ``on_fresh``)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"out of KV blocks: need {num_blocks}, {len(self.free_ids)} free")
        ids = [heapq.heappop(self.free_ids) for _ in range(num_blocks)]
        for b in ids:
            self.refs[b] = 1
        if ids and fresh and self.on_fresh is not None:
            self.on_fresh(ids)
        return ids

    def grow(self, table: list[int], num_tokens: int) -> list[int]:
        """Extend ``table`` in place to hold ``num_tokens`` tokens; returns it."""
        extra = self.blocks_for(num_tokens) - len(table)
        if extra > 0:
            table.extend(self.allocate(extra))
        return table

    def fork(self, table: list[int], num_tokens: int) -> list[int]:
        """A new table whose first ``num_tokens`` tokens equal ``table``'s: full blocks shared,
        the partially filled last block copied into a fresh one."""
        full, partial = divmod(num_tokens, self.block_size)
        shared = table[:full]
        for b in shared:
            self.refs[b] += 1
        if not partial:
            return list(shared)
        new = self.allocate(1, fresh=self.on_copy is None)[0]  # the copy overwrites every tensor of the block
        if self.on_copy is not None:
            self.on_copy(table[full], new)
        return shared + [new]

    def free(self, table: list[int]) -> None:
        for b in reversed(table):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                heapq.heappush(self.free_ids, b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
        table.clear()

    def free_blocks(self) -> list[int]:
        return sorted(self.free_ids)

    def used_blocks(self) -> list[int]:
        return [b for b, r in enumerate(self.refs) if r > 0]

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Slots of positions ``start..end-1``."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
