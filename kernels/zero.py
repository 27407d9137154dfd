"""Triton zeroing of KV blocks across every layer's K, V and scale caches in one launch.

Same name and signature as :func:`kvdiag.kernels.reference.zero_blocks`. The tensors
are reached from the first one's address: a small int64 table holds, per tensor, its
offset from that base and its block size, both in 16-byte units, so every store is a
16-byte vector. Program (i, t) zeroes block ``block_ids[i]`` of tensor ``t``. A tensor
whose blocks are not contiguous 16-byte multiples goes through the reference instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdiag.kernels import reference

CHUNK_WORDS = 4096  # int32 words a program stores per loop step (16 KiB)


@triton.jit
def _zero_kernel(base, table, ids, CHUNK: tl.constexpr):
    blk = tl.load(ids + tl.program_id(0)).to(tl.int64)
    t = tl.program_id(1)
    off16, n16 = tl.load(table + 2 * t), tl.load(table + 2 * t + 1)
    words = base.to(tl.pointer_type(tl.int32)) + (off16 + blk * n16) * 4
    n_words = n16 * 4
    zeros = tl.zeros([CHUNK], tl.int32)
    for c in range(0, n_words, CHUNK):
        w = c + tl.arange(0, CHUNK)
        tl.store(words + w, zeros, mask=w < n_words)


def _block_bytes(t: torch.Tensor) -> int | None:
    """Bytes of one dim-0 block if blocks are contiguous, 16-byte aligned multiples of 16, else None."""
    n = t.stride(0) * t.element_size()
    if not t.is_contiguous() or n % 16 or t.data_ptr() % 16:
        return None
    return n


def zero_blocks(block_ids, tensors, chunk_words: int = CHUNK_WORDS, num_warps: int = 8) -> None:
    """See :func:`kvdiag.kernels.reference.zero_blocks`."""
    tensors = [t for t in tensors if t is not None]
    if len(block_ids) == 0 or not tensors:
        return
    fast = [t for t in tensors if _block_bytes(t) is not None]
    slow = [t for t in tensors if _block_bytes(t) is None]
    if slow:
        reference.zero_blocks(block_ids, slow)
    if not fast:
        return
    base = fast[0]
    table = [v for t in fast for v in ((t.data_ptr() - base.data_ptr()) // 16, _block_bytes(t) // 16)]
    if isinstance(block_ids, torch.Tensor):
        meta = torch.tensor(table, dtype=torch.int64, device=base.device)
        ids = block_ids.to(device=base.device)
    else:  # one host-to-device copy for table and ids
        meta = torch.tensor(table + [int(b) for b in block_ids], dtype=torch.int64, device=base.device)
        ids = meta[len(table):]
    _zero_kernel[(len(ids), len(fast))](base, meta, ids, CHUNK=chunk_words, num_warps=num_warps)
