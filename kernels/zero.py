"""Triton zeroing of KV blocks across every layer's K, V and scale caches in one launch.

Same name and signature as :func:`kvdiag.kernels.reference.zero_blocks`. The tensors
are reached from the first one's address: a small int64 table holds, per tensor, its
offset from that base and its block size, both in 16-byte units, so every store is a
16-byte vector. Program (i, g) zeroes block ``block_ids[i]`` of tensors ``g * GROUP`` to
``g * GROUP + GROUP - 1`` (one tensor per program left the scale caches' 512-byte blocks
each a program of its own: 0.36x copy for int8_per_token_head, BENCHMARKS.md). A tensor
whose blocks are not contiguous 16-byte multiples goes through the reference instead.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from kvdiag.kernels import reference
from kvdiag.kernels.launch import Launcher, cdiv

CHUNK_WORDS = 4096  # int32 words a program stores per loop step (16 KiB)
GROUP = 8  # tensors a program zeroes (its block of each): small blocks (scale caches) share a program


@triton.jit
def _zero_kernel(base, table, ids, num_tensors, GROUP: tl.constexpr, CHUNK: tl.constexpr):
    blk = tl.load(ids + tl.program_id(0)).to(tl.int64)
    first = tl.program_id(1) * GROUP
    zeros = tl.zeros([CHUNK], tl.int32)
    for t in range(first, tl.minimum(first + GROUP, num_tensors)):
        off16, n16 = tl.load(table + 2 * t), tl.load(table + 2 * t + 1)
        words = base.to(tl.pointer_type(tl.int32)) + (off16 + blk * n16) * 4
        n_words = n16 * 4
        for c in range(0, n_words, CHUNK):
            w = c + tl.arange(0, CHUNK)
            tl.store(words + w, zeros, mask=w < n_words)


_ZERO = Launcher(_zero_kernel)


def _block_bytes(t: torch.Tensor) -> int | None:
    """Bytes of one dim-0 block if blocks are contiguous, 16-byte aligned multiples of 16, else None."""
    n = t.stride(0) * t.element_size()
    if not t.is_contiguous() or n % 16 or t.data_ptr() % 16:
        return None
    return n


_plans: dict = {}  # ids of a tensor list -> (weak references, data pointers, plan): the engine's lists repeat


def _plan(tensors: list) -> tuple[list, list, list]:
    """(indices of the tensors the kernel zeroes, of those the reference zeroes, the kernel's offset/size table),
    reused while the same tensor objects are alive at the same addresses (no reference to them is kept)."""
    key = tuple(map(id, tensors))
    hit = _plans.get(key)
    if hit is not None and all(r() is t for r, t in zip(hit[0], tensors)) and \
            hit[1] == [t.data_ptr() for t in tensors]:
        return hit[2]
    sizes = [_block_bytes(t) for t in tensors]
    fast = [i for i, n in enumerate(sizes) if n is not None]
    base = tensors[fast[0]].data_ptr() if fast else 0
    plan = (fast, [i for i, n in enumerate(sizes) if n is None],
            [v for i in fast for v in ((tensors[i].data_ptr() - base) // 16, sizes[i] // 16)])
    if len(_plans) >= 8:
        _plans.clear()
    _plans[key] = ([weakref.ref(t) for t in tensors], [t.data_ptr() for t in tensors], plan)
    return plan


def zero_blocks(block_ids, tensors, chunk_words: int = CHUNK_WORDS, num_warps: int = 8, group: int = GROUP) -> None:
    """See :func:`kvdiag.kernels.reference.zero_blocks` (``chunk_words``, ``num_warps``, ``group``: tuning)."""
    tensors = [t for t in tensors if t is not None]
    if len(block_ids) == 0 or not tensors:
        return
    fast, slow, table = _plan(tensors)
    if slow:
        reference.zero_blocks(block_ids, [tensors[i] for i in slow])
    if not fast:
        return
    base = tensors[fast[0]]
    ids = block_ids if isinstance(block_ids, torch.Tensor) else None
    if ids is None:  # one host-to-device copy for table and ids
        table = table + [int(b) for b in block_ids]
    meta = torch.tensor(table, dtype=torch.int64)
    if base.is_cuda:  # from pinned memory without waiting: a pageable copy would synchronize the stream
        meta = meta.pin_memory().to(base.device, non_blocking=True)
    ids = meta[2 * len(fast):] if ids is None else ids.to(device=base.device)
    _ZERO((len(ids), cdiv(len(fast), group)), (base, meta, ids, len(fast)),
          dict(GROUP=group, CHUNK=chunk_words), num_warps=num_warps)
