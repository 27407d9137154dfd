"""Torch reference kernels for the paged KV cache: quantize, store, attend, zero.

These functions define what the cache holds and what attention sees, for every
kv dtype of :mod:`kvdiag.dtypes` (vLLM's semantics). The Triton kernels in
``store.py``/``attention.py``/``zero.py`` must match them; ``dispatch.py`` picks
one or the other. All quantization arithmetic is float32.

Layouts (docs/DESIGN.md, "Cache layout"):
    k_cache, v_cache              [num_blocks, block_size, num_kv_heads, head_size]
    k_scale_cache, v_scale_cache  [num_blocks, block_size, num_kv_heads] float32
                                  (per-token-head dtypes only, else None)
    slot = block_id * block_size + offset_in_block
"""

from __future__ import annotations

import torch

from kvdiag.dtypes import BUILTIN_DTYPES, SCALE_FLOOR

# attention works on groups of sequences of at most this many score elements
ATTN_GROUP_ELEMENTS = 1 << 24


def _kv(kv_dtype: str):
    d = BUILTIN_DTYPES.get(kv_dtype)
    if d is None:
        raise ValueError(f"unknown kv dtype {kv_dtype!r}; valid: {', '.join(BUILTIN_DTYPES)}")
    return d


def round_half_away(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (C's ``roundf``), exactly: no ``y + 0.5`` rounding error."""
    t = torch.trunc(y)
    return t + torch.sign(y) * ((y - t).abs() >= 0.5).to(y.dtype)


def quantize_per_token_head(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., num_kv_heads, head_size] with one float32 scale per (token, kv head).

    ``scale = max(absmax / qmax, 1e-6)`` with qmax 127 (``int8_per_token_head``) or 448
    (``fp8_per_token_head``). int8 codes are ``round_half_away(x / scale)`` clamped to
    [-128, 127]; fp8 codes are ``float8_e4m3fn(x / scale)`` (saturated to ±448).
    Returns ``(codes [..., num_kv_heads, head_size], scales [..., num_kv_heads] float32)``.
    """
    d = _kv(kv_dtype)
    if d.quant != "per_token_head":
        raise ValueError(f"{kv_dtype} is not a per-token-head dtype")
    xf = x.float()
    # divide by a 0-d tensor, not a Python float: CUDA torch turns `/ float` into `* (1/float)`,
    # which can differ in the last bit from the IEEE division the CPU (and the Triton kernel) does
    scales = torch.clamp(xf.abs().amax(dim=-1) / xf.new_full((), d.qmax), min=SCALE_FLOOR)
    y = xf / scales.unsqueeze(-1)
    if d.storage == "int8":
        codes = round_half_away(y).clamp(-128, 127).to(torch.int8)
    else:
        codes = y.clamp(-d.qmax, d.qmax).to(getattr(torch, d.storage))
    return codes, scales


def quantize_per_tensor(x: torch.Tensor, kv_dtype: str, scale) -> torch.Tensor:
    """fp8 per-tensor codes: ``(x / scale)`` in float32, saturated to ±qmax (448 e4m3, 57344 e5m2).

    ``scale`` is a float or a 0-d float32 tensor.
    """
    d = _kv(kv_dtype)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)  # IEEE division on CUDA too
    return (x.float() / scale).clamp(-d.qmax, d.qmax).to(getattr(torch, d.storage))


def dequantize(codes: torch.Tensor, kv_dtype: str, scale=None, scales: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values of cache entries ``codes`` [..., num_kv_heads, head_size] (written into ``out`` if given).

    Unquantized dtypes: ``codes.float()``. Per-tensor fp8: ``codes.float() * scale``.
    Per-token-head: ``codes.float() * scales[..., None]`` with ``scales`` [..., num_kv_heads].
    """
    d = _kv(kv_dtype)
    if d.quant == "none":
        return codes.float() if out is None else out.copy_(codes)
    factor = scale if d.quant == "per_tensor" else scales.unsqueeze(-1)
    return torch.mul(codes.float(), factor, **({} if out is None else {"out": out}))


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_dtype: str, k_scale=1.0, v_scale=1.0,
             k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None) -> None:
    """Write new tokens' K/V into the paged cache (vLLM's ``reshape_and_cache_flash``).

    key, value: [num_tokens, num_kv_heads, head_size] in the model dtype.
    slot_mapping: [num_tokens] int64; token t goes to slot ``slot_mapping[t]``; -1 is skipped.
    kv_dtype: a registry name. Unquantized: stored as ``x.to(cache dtype)``. Per-tensor fp8:
    :func:`quantize_per_tensor` with ``k_scale``/``v_scale`` (float or 0-d float32 tensor).
    Per-token-head: :func:`quantize_per_token_head`; the scales go to ``k/v_scale_cache``.
    """
    d = _kv(kv_dtype)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    if slots.numel() == 0:
        return
    key, value = key[valid], value[valid]
    kc, vc = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    if d.quant == "none":
        kc[slots] = key.to(kc.dtype)
        vc[slots] = value.to(vc.dtype)
    elif d.quant == "per_tensor":
        kc[slots] = quantize_per_tensor(key, kv_dtype, k_scale)
        vc[slots] = quantize_per_tensor(value, kv_dtype, v_scale)
    else:
        for x, cache, scale_cache in ((key, kc, k_scale_cache), (value, vc, v_scale_cache)):
            codes, scales = quantize_per_token_head(x, kv_dtype)
            cache[slots] = codes
            scale_cache.flatten(0, 1)[slots] = scales


def zero_blocks(block_ids, tensors) -> None:
    """Zero blocks ``block_ids`` (list or 1-D int tensor) along dim 0 of every tensor in ``tensors``
    (K, V and scale caches of all layers). Other blocks are untouched."""
    if len(block_ids) == 0:
        return
    for t in tensors:
        if t is None:
            continue
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=t.device)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        t.view(bits).index_fill_(0, idx, 0)  # all-zero bits are 0.0 in every float format (fp8 has no index_fill)


def _groups(q_lens, read_lens, num_heads):
    """Split sequences into runs whose padded score tensor stays under ATTN_GROUP_ELEMENTS."""
    start, qmax, rmax = 0, 0, 0
    for i, (q, r) in enumerate(zip(q_lens, read_lens)):
        nq, nr = max(qmax, q), max(rmax, r)
        if i > start and (i - start + 1) * num_heads * nq * nr > ATTN_GROUP_ELEMENTS:
            yield start, i
            start, nq, nr = i, q, r
        qmax, rmax = nq, nr
    if start < len(q_lens):
        yield start, len(q_lens)


def _gather(cache, scale_cache, kv_dtype, scale, slots, valid):
    """Dequantized float32 cache rows at ``slots[valid]`` ([n, rmax] slots, bool mask), in a zero
    tensor [n, rmax, num_kv_heads, head_size]. Only the valid slots are read."""
    idx = slots[valid]
    scales = scale_cache.flatten(0, 1)[idx] if scale_cache is not None else None
    out = torch.zeros(*slots.shape, *cache.shape[2:], dtype=torch.float32, device=cache.device)
    out[valid] = dequantize(cache.flatten(0, 1)[idx], kv_dtype, scale, scales)
    return out


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, kv_dtype: str = "auto", k_scale=1.0, v_scale=1.0,
                    k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None,
                    whole_page_reads: bool = False) -> torch.Tensor:
    """Causal attention of packed new tokens over each sequence's paged K/V (ragged batch).

    query: [num_tokens, num_heads, head_size]; sequence s owns rows
    ``query_start_loc[s]:query_start_loc[s+1]`` (int32 [num_seqs+1]) - its last q_len tokens.
    seq_lens: int32 [num_seqs], context length including the new tokens, whose K/V must
    already be stored. block_tables: int32 [num_seqs, max_blocks_per_seq]; position p of
    sequence s is at slot ``block_tables[s, p // block_size] * block_size + p % block_size``.
    New token j (0-based) of s sits at position ``seq_lens[s] - q_len + j`` and attends
    positions 0..that position. GQA: head h reads kv head ``h // (num_heads // num_kv_heads)``.
    K/V are dequantized to float32 (see :func:`dequantize`), scores ``q·k * scale`` and the
    softmax are float32; the output [num_tokens, num_heads, head_size] has query's dtype.
    Decode is the q_len == 1 case.

    Positions >= seq_len are never read. ``whole_page_reads=True`` (fault S3) reads every
    slot of each used block instead: scores there are -inf but their V is still multiplied
    by weight 0, so NaN in an unwritten slot makes the output NaN.
    """
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    dev = query.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    reads = [-(-n // block_size) * block_size if whole_page_reads else n for n in lens]
    out = torch.empty_like(query)
    for a, b in _groups(q_lens, reads, num_heads):
        n, qmax, rmax = b - a, max(q_lens[a:b]), max(reads[a:b])
        key_pos = torch.arange(rmax, device=dev).view(1, rmax)
        valid = key_pos < torch.tensor(reads[a:b], device=dev).view(n, 1)  # [n, rmax]: slots read
        tables = block_tables[a:b, :-(-rmax // block_size)].long()
        slots = tables.gather(1, key_pos.expand(n, rmax) // block_size) * block_size + key_pos % block_size
        k = _gather(k_cache, k_scale_cache, kv_dtype, k_scale, slots, valid)
        v = _gather(v_cache, v_scale_cache, kv_dtype, v_scale, slots, valid)
        ql = torch.tensor(q_lens[a:b], device=dev).view(n, 1)
        q_valid = torch.arange(qmax, device=dev).view(1, qmax) < ql  # [n, qmax]: real query rows
        rows = slice(starts[a], starts[b])
        q = torch.zeros(n, qmax, num_heads, head_size, dtype=torch.float32, device=dev)
        q[q_valid] = query[rows].float()
        q = q.view(n, qmax, num_kv_heads, group, head_size)
        scores = torch.einsum("nqkgd,nlkd->nkgql", q, k) * scale
        ctx = torch.tensor(lens[a:b], device=dev).view(n, 1, 1)
        last = ctx - ql.view(n, 1, 1) + torch.arange(qmax, device=dev).view(1, qmax, 1)  # [n, qmax, 1]
        kp = key_pos.view(1, 1, rmax)
        allowed = ((kp <= last) & (kp < ctx)) | (~q_valid.view(n, qmax, 1) & (kp == 0))  # pad rows: key 0
        scores = scores.masked_fill(~allowed.view(n, 1, 1, qmax, rmax), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("nkgql,nlkd->nqkgd", probs, v).reshape(n, qmax, num_heads, head_size)
        out[rows] = o[q_valid].to(query.dtype)
    return out
