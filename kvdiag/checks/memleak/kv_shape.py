"""memleak's survivors shaped by the KV cache (docs/DESIGN.md, "memleak"): a tensor that survives shutdown and whose
leading dimensions index the cache's blocks or token slots, per layer, fails whatever its size. Shapes that count
(``G``: the cache's ``num_blocks`` or its token slots ``num_blocks x block_size``): ``[G, ...]`` (``[num_blocks,
block_size, ...]`` among them), also behind one leading dimension of 2 (K and V), the layer count or twice it. A per-
token-head scale cache (``[num_blocks, block_size, num_kv_heads]`` float32), a copy of a layer's K, a per-slot table:
each is sized by the cache, so a user's 60 GiB cache makes it large however small it is here, and one such tensor per
layer slips a rule that weighs one storage at a time.

Why shapes and not bare element counts: with the power-of-two geometries kvdiag runs (16 blocks of 16 slots), every
power-of-two buffer's element count is a multiple of the slots (vLLM's 64 KiB Triton buffer cache among them); a flat
tensor is judged by its holder's bytes (``kv_scaled.py``) and, with ``--kv-sizes``, by its ratio (``kv_ratio.py``). A
buffer of fixed size whose leading dimension happens to equal the cache's blocks or slots would be taken for KV-
shaped; with ``--kv-sizes`` the ratio decides: a holder that stays the same at both sizes is not judged by its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.measure.memory import MiB


@dataclass(frozen=True)
class Geometry:
    """The KV cache's geometry, from the engine's ``kv_blocks()`` view during the workload."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    layers: int

    @property
    def slots(self) -> int:
        return self.num_blocks * self.block_size

    def to_json(self) -> dict:
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                "head_size": self.head_size, "layers": self.layers}


def geometry(view) -> Geometry | None:
    """The geometry of a ``KVBlockView`` (None without attention layers: a cache of states only)."""
    if view is None or not view.layers or view.num_blocks < 1:
        return None
    shape = tuple(view.layers[0].k.shape)
    heads, head = (shape[2], shape[3]) if len(shape) == 4 else (1, shape[-1])
    return Geometry(view.num_blocks, view.block_size, heads, head, len(view.layers))


def shaped(shape: tuple, geo: Geometry) -> bool:
    """Whether a tensor of ``shape`` indexes the cache's blocks or slots along its leading dimensions (docstring)."""
    shape = tuple(shape)
    if len(shape) > 1 and shape[0] in {2, geo.layers, 2 * geo.layers} and _indexes(shape[1:], geo):
        return True
    return _indexes(shape, geo)


def _indexes(shape: tuple, geo: Geometry) -> bool:
    return bool(shape) and shape[0] in (geo.num_blocks, geo.slots)  # [num_blocks, block_size, ...] included


def keys(candidates, geo: Geometry | None) -> tuple[frozenset, list[str]]:
    """(census keys, distinct shapes) of the tensors among ``candidates`` (survivors, the KV cache's own storages
    left out) that are KV-shaped."""
    if geo is None or not candidates:
        return frozenset(), []
    from kvdiag.measure.memory import live_tensors, storage_key

    out, shapes = set(), {}
    for t in live_tensors(candidates):
        st = storage_key(t)
        if st is not None and shaped(t.shape, geo):
            out.add((id(t), st[0], st[1]))
            shapes["[" + "x".join(map(str, t.shape)) + "] " + str(t.dtype).replace("torch.", "")] = None
    return frozenset(out), list(shapes)


def findings(rec, cycles: list) -> None:
    """One error ``kv_shaped_survived`` for the last cycle that left KV-shaped survivors, with their holders and
    shapes; the geometry of every cycle in the metrics."""
    rec.metrics["kv_geometry"] = [c.kv.geometry.to_json() if c.kv is not None and c.kv.geometry else None
                                  for c in cycles]
    from kvdiag.checks.memleak import kv_ratio

    constant = kv_ratio.constant(cycles)  # the ratio's proof beats the shape
    hit = [(n, c) for n, c in enumerate(cycles, 1) if [h for h in c.kv_shaped if h.holder not in constant]]
    if not hit:
        return
    n, c = hit[-1]
    shaped = [h for h in c.kv_shaped if h.holder not in constant]
    geo, kv = c.kv.geometry, c.kv.bytes
    total = sum(h.bytes for h in shaped)
    count = sum(h.count for h in shaped)
    names = "; ".join(f"{h.holder}: {h.bytes / MiB:.3g} MiB in {h.count} storage(s)" for h in shaped)
    rec.add("error", "kv_shaped_survived", f"{total / MiB:.3g} MiB in {count} storage(s) shaped by the KV cache "
            f"(shapes {', '.join(c.kv_shapes)}; the cache: {geo.layers} layers of {geo.num_blocks} blocks x "
            f"{geo.block_size} slots x {geo.num_kv_heads} heads x {geo.head_size}) survive shutdown (cycle {n}), "
            f"held by {names}; indexed by the cache's blocks or slots, they grow with it (with a 60 GiB cache: "
            f"{total / kv * 60:.2g} GiB), a failure whatever their size", cycle=n, mib=round(total / MiB, 3),
            storages=count, shapes=list(c.kv_shapes), geometry=geo.to_json(), kv_cache_mib=round(kv / MiB, 3),
            share=round(total / kv, 4), cycles=[m for m, _ in hit], holder=shaped[0].holder,
            holders=[h.to_json() for h in shaped])
