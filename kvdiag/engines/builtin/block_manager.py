"""Free-list block allocator with reference counts, per-sequence block tables, slot mapping and a prefix cache.

A block table is a plain ``list[int]`` of block ids; position p of a sequence lives in
slot ``table[p // block_size] * block_size + p % block_size``. Fresh blocks are
handed to ``on_fresh`` (the engine zeroes them) before anyone writes to them. The
lowest free id is taken first, so a cache that was emptied is refilled in the same order
(deterministic, and freed blocks are reused at once).
:meth:`fork` shares a table's full blocks and copies its partially filled last block
(copy-on-write for scoring several continuations after one context).

Prefix cache (vLLM's automatic prefix caching; only ``generate`` with prefix caching on registers blocks): a full,
written block may be given the chain hash of its tokens (:func:`chain_hashes`) with :meth:`cache`; :meth:`match`
finds the longest run of cached blocks for a chain and :meth:`take` references them again (no copy, no zeroing).

Invariants (every block is in exactly one of three states):

- plain free: in ``free_ids`` (a heap), ``refs`` 0, no hash;
- cached and evictable: in ``evictable`` (least recently freed first), ``refs`` 0, a hash;
- held: ``refs`` > 0 (the number of tables holding it), with or without a hash.

``hash_of`` (block -> hash) and ``cached`` (hash -> block) are inverse maps. :meth:`free_blocks` is every block no
sequence holds: the plain free ones AND the cached-unreferenced ones (vLLM's free pool holds both; poison fills
them all). :meth:`allocate` takes plain free blocks first, then evicts the least recently freed cached block
(its hash is dropped and it is handed out as fresh; ``on_evict`` hears of each). Without :meth:`cache` the prefix
cache stays empty and the allocator behaves exactly as a plain free list.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from typing import Callable, Sequence


def chain_hashes(tokens: Sequence[int], block_size: int, num_blocks: int, parents: list[bytes]) -> list[bytes]:
    """Extend ``parents`` (the chain hashes of the first blocks of ``tokens``) to ``num_blocks`` full blocks; each
    hash covers (parent hash, the block's token ids), as vLLM's block hashes do. sha256: no false hit on a collision.
    """
    while len(parents) < num_blocks:
        i = len(parents)
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = parents[-1] if parents else b""
        parents.append(hashlib.sha256(parent + ",".join(map(str, block)).encode()).digest())
    return parents[:num_blocks]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, on_fresh: Callable[[list[int]], None] | None = None,
                 on_copy: Callable[[int, int], None] | None = None, on_evict: Callable[[int], None] | None = None,
                 stale_hashes: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.on_fresh, self.on_copy, self.on_evict = on_fresh, on_copy, on_evict
        self.stale_hashes = stale_hashes  # fault evicted_block_keeps_hash: an evicted block keeps its hash
        self.free_ids: list[int] = list(range(num_blocks))  # a heap
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no table holds, LRU first

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int, fresh: bool = True) -> list[int]:
        """Take blocks off the free list; ``fresh=False``: the caller overwrites them whole (no ``on_fresh``)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"out of KV blocks: need {num_blocks}, {self.num_free} free")
        ids = [heapq.heappop(self.free_ids) for _ in range(min(num_blocks, len(self.free_ids)))]
        while len(ids) < num_blocks:  # evict the least recently freed cached blocks
            b = self.evictable.popitem(last=False)[0]
            if not self.stale_hashes:
                del self.cached[self.hash_of.pop(b)]
            ids.append(b)
            if self.on_evict is not None:
                self.on_evict(b)
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
        """Drop ``table``'s references; a block nobody holds any more goes to the free pool (a cached one stays
        cached, evictable). Last block first: the tail of a sequence is evicted before its head, as in vLLM."""
        for b in reversed(table):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    heapq.heappush(self.free_ids, b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
        table.clear()

    def free_blocks(self) -> list[int]:
        """Blocks no sequence holds (plain free and cached-unreferenced ones alike)."""
        return sorted(self.free_ids + list(self.evictable))

    def used_blocks(self) -> list[int]:
        return [b for b, r in enumerate(self.refs) if r > 0]

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Slots of positions ``start..end-1``."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ----- prefix cache ------------------------------------------------------------------------
    def cache(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Register full, written ``blocks`` (held) under their chain ``hashes``. A hash another block already
        holds keeps that block (two requests computed the same prefix at once; vLLM keeps the first too)."""
        for b, h in zip(blocks, hashes):
            if b not in self.hash_of and h not in self.cached:
                self.hash_of[b], self.cached[h] = h, b

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest leading run of ``hashes``."""
        out = []
        for h in hashes:
            if (b := self.cached.get(h)) is None:
                break
            out.append(b)
        return out

    def take(self, blocks: Sequence[int], fresh: bool = False) -> list[int]:
        """Reference cached ``blocks`` again (a prefix-cache hit); ``fresh``: hand them to ``on_fresh`` as well
        (the fault ``prefix_hit_treated_fresh``)."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.evictable[b]
            self.refs[b] += 1
        if blocks and fresh and self.on_fresh is not None:
            self.on_fresh(list(blocks))
        return list(blocks)

    def reclaim(self, blocks: Sequence[int]) -> list[int]:
        """Reference ``blocks`` again whatever state they are in now, without zeroing: a free one is taken back off
        the free pool, one another table holds is shared. Only the fault ``preempt_keeps_freed_blocks`` does this."""
        taken = False
        for b in blocks:
            if self.refs[b] == 0:
                if b in self.evictable:
                    del self.evictable[b]
                else:
                    self.free_ids.remove(b)
                    taken = True
            self.refs[b] += 1
        if taken:
            heapq.heapify(self.free_ids)
        return list(blocks)

    def reset_cache(self) -> bool:
        """Drop every hash (cached-unreferenced blocks become plain free). False, dropping nothing, while a sequence
        still holds a cached block (as vLLM's ``reset_prefix_cache``)."""
        if any(self.refs[b] for b in self.hash_of):
            return False
        for b in self.evictable:
            heapq.heappush(self.free_ids, b)
        self.hash_of.clear()
        self.cached.clear()
        self.evictable.clear()
        return True
