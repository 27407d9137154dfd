"""What the KV checks do to an engine's cache tensors through its :class:`KVBlockView`:
size them, say what they store, fingerprint every slot, fill blocks with poison, and scan
slots for values no correct write produces (NaN/Inf codes, scales that are not finite and > 0).

A *slot* is one token position of one block (``block * block_size + offset``); every cache
tensor is viewed as ``[num_blocks * block_size, bytes per slot]``. A hybrid model's state tensors (``view.states``,
one state per block) are handled per block: filled with the K/V of the same block ids, fingerprinted per block
apart from the slots (``state_fingerprint``), scanned only in the blocks last handed to a state group
(``view.state_blocks()``), whose K/V are not scanned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POISON_VALUES = ("nan", "inf", "max", "random")
CHUNK_BYTES = 32 << 20  # temporaries of the slot loops stay under ~8x this


def cache_tensors(view) -> list[tuple[str, object]]:
    """``(name, tensor)`` of every layer's k, v and scale caches, e.g. ``("3.k_scale", t)``."""
    out = []
    for i, layer in enumerate(view.layers):
        for name in ("k", "v", "k_scale", "v_scale"):
            t = getattr(layer, name, None)
            if t is not None:
                out.append((f"{i}.{name}", t))
    return out


def state_tensors(view) -> list[tuple[str, object]]:
    """``(name, tensor)`` of every state layer's tensors, e.g. ``("model.layers.0.mixer.ssm", t)``."""
    return [(f"{s.name}.{k}", t) for s in getattr(view, "states", ()) for k, t in s.tensors.items()]


def kv_bytes(view) -> int:
    """Bytes the cache holds: the layers' k, v and scale tensors (a tensor seen twice counts once)."""
    seen = {(t.data_ptr(), t.nbytes) for _, t in cache_tensors(view)}
    return sum(n for _, n in seen)


def storage_summary(view) -> dict:
    """What the cache really stores, from its tensors: each layer's element dtype (``"int8"``, ``"K/V"`` when K and
    V differ), bytes one token takes in K and in V summed over the layers (kv heads x head size x element bytes),
    and in the scale caches, whether there are scale tensors, and the size of each element dtype seen."""
    layer_dtypes, sizes, k, v, scale, scales = [], {}, 0, 0, 0, False
    for layer in view.layers:
        names = [str(t.dtype).removeprefix("torch.") for t in (layer.k, layer.v)]
        sizes.update({n: t.element_size() for n, t in zip(names, (layer.k, layer.v))})
        layer_dtypes.append(names[0] if names[0] == names[1] else "/".join(names))
        k, v = k + token_bytes(layer.k, view), v + token_bytes(layer.v, view)
        for t in (layer.k_scale, layer.v_scale):
            if t is not None:
                scales, scale = True, scale + token_bytes(t, view)
    return {"layers": len(view.layers), "layer_dtypes": layer_dtypes, "element_bytes": sizes,
            "k_bytes_per_token": k, "v_bytes_per_token": v, "scale_bytes_per_token": scale, "scales": scales}


def token_bytes(t, view) -> int:
    """Bytes one token (slot) takes in ``t``, shaped [num_blocks, block_size, ...]; 0 for a per-tensor scale."""
    if t.dim() < 2 or tuple(t.shape[:2]) != (view.num_blocks, view.block_size):
        return 0
    return t[0, 0].numel() * t.element_size()


def slot_rows(t, num_slots: int):
    """``t``'s raw bits as ``[num_slots, words]``: int32 words when a slot's bytes allow, else
    int16 or uint8 (a view when ``t`` is contiguous)."""
    import torch

    raw = t.contiguous().view(torch.uint8).view(num_slots, -1)
    for word in (torch.int32, torch.int16):
        if raw.shape[1] % word.itemsize == 0:
            return raw.view(word)
    return raw


def _chunks(num_rows: int, row_bytes: int):
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for a in range(0, num_rows, step):
        yield a, min(num_rows, a + step)


def slot_fingerprint(view):
    """One int64 per slot that changes (almost surely) when any byte of that slot's K, V or scales changes in any
    layer. State tensors are not in it (:func:`state_fingerprint`): a state is one per block, and spreading its
    change over the block's slots would mark slots no attention layer wrote as written (where states overlay the K/V
    pages, a vLLM hybrid's, a state write already changes the K/V bytes it covers)."""
    import torch

    num_slots = view.num_blocks * view.block_size
    total = None
    for n, (_, t) in enumerate(cache_tensors(view)):
        total = _hash_rows(slot_rows(t, num_slots), 1000 + n, total)
    return total.cpu() if total is not None else torch.zeros(num_slots, dtype=torch.int64)


def state_fingerprint(view):
    """One int64 per block that changes (almost surely) when any byte of that block's states changes; None without
    state tensors."""
    blocks = None
    for n, (_, t) in enumerate(state_tensors(view)):
        blocks = _hash_rows(slot_rows(t, view.num_blocks), 5000 + n, blocks)
    return blocks.cpu() if blocks is not None else None


def _hash_rows(rows, seed: int, total):
    """``total`` (a new int64 tensor when None) plus one seeded hash of each row of ``rows``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2 ** 62), 2 ** 62, (rows.shape[1],), generator=g, dtype=torch.int64).to(rows.device)
    if total is None:
        total = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
    for a, b in _chunks(rows.shape[0], rows.shape[1] * 8):
        total[a:b] += (rows[a:b].long() * w).sum(1)  # int64 arithmetic wraps: a hash, not a sum
    return total


def block_slots(blocks, block_size: int):
    """The slots of ``blocks`` as a sorted int64 tensor."""
    import torch

    b = torch.as_tensor(sorted(set(blocks)), dtype=torch.int64)
    return (b.view(-1, 1) * block_size + torch.arange(block_size).view(1, -1)).flatten()


# --------------------------------------------------------------------------- poison


def fill_numbers(value: str, kv_cache_dtype: str) -> dict:
    """What ``value`` (zero or a poison but random) puts in a cache tensor of each dtype a cache is stored in, as
    :func:`fill_blocks` puts it, for a script that fills without kvdiag (``kvdiag.proof``): a float as text (nan and
    inf have no literal), a 1-byte dtype the code's bits; uint8 is the storage of vLLM's fp8 cache
    (``kv_cache_dtype``'s format)."""
    import torch

    out = {}
    for name in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"):
        dtype = getattr(torch, name)
        if name == "uint8":
            dtype = torch.float8_e5m2 if "e5m2" in kv_cache_dtype else torch.float8_e4m3fn
        x = 0.0 if value == "zero" else poison_scalar(dtype, value)
        out[name] = int(torch.tensor([x]).to(dtype).view(torch.uint8).item()) if dtype.itemsize == 1 else str(x)
    return out


def poison_scalar(dtype, value: str) -> float | None:
    """The poison a tensor of ``dtype`` gets for ``--value``; None for ``random`` (seeded random bits).

    nan: NaN (int8 codes: -128, their scales carry the NaN). inf: +inf; float8_e4m3fn has no
    inf, so its NaN code. max: the dtype's largest finite value.
    """
    import torch

    if value == "random":
        return None
    if value not in POISON_VALUES:
        raise ValueError(f"poison value {value!r}; valid: {', '.join(POISON_VALUES)}")
    if not dtype.is_floating_point:
        return float(torch.iinfo(dtype).max if value == "max" else torch.iinfo(dtype).min)
    if value == "max":
        return float(torch.finfo(dtype).max)
    if value == "inf" and dtype == torch.float8_e4m3fn:
        return float("nan")
    return float(value)


def fill_blocks(view, blocks, value: str, seed: int = 0) -> int:
    """Under ``torch.inference_mode()``: an engine's cache tensors may be inference tensors (vLLM's per-token-head
    scale caches are made inside it), which refuse in-place writes outside it."""
    import torch

    with torch.inference_mode():
        return _fill_blocks(view, blocks, value, seed)


def _fill_blocks(view, blocks, value: str, seed: int = 0) -> int:
    """Fill ``blocks`` of every k, v and scale cache, and of every state tensor, with poison (or ``zero``);
    returns bytes written."""
    import torch

    if len(blocks) == 0:
        return 0
    written = 0
    # states first: where they overlay K/V pages (vLLM's hybrid groups) the K/V poison lands last, and a K/V NaN or
    # Inf read as a wider state is non-finite too, while an fp32 NaN read as bf16 K/V is half zeros
    for n, (_, t) in enumerate(state_tensors(view) + cache_tensors(view)):
        idx = torch.as_tensor(list(blocks), dtype=torch.int64, device=t.device)
        if value == "random":
            _fill_random(t, idx, seed * 7919 + n)
        else:
            x = 0.0 if value == "zero" else poison_scalar(t.dtype, value)
            if t.element_size() == 1:  # fp8/int8: fill the code's bits (index_fill_ has no fp8 kernels)
                code = int(torch.tensor([x]).to(t.dtype).view(torch.uint8).item())
                t.view(torch.uint8).index_fill_(0, idx, code)
            else:
                t.index_fill_(0, idx, x)
        written += len(blocks) * t[0].nbytes
    return written


def _fill_random(t, idx, seed: int) -> None:
    """Seeded random bits into blocks ``idx`` of ``t``, a chunk of blocks at a time."""
    import torch

    g = torch.Generator(device=t.device).manual_seed(seed)
    row_bytes = t[0].numel() * t.element_size()  # t may be a strided (non-contiguous) view
    for a, b in _chunks(len(idx), row_bytes):
        bits = torch.randint(0, 256, (b - a, row_bytes), generator=g, dtype=torch.uint8, device=t.device)
        t[idx[a:b]] = bits.view(t.dtype).view(b - a, *t.shape[1:])


# --------------------------------------------------------------------------- scan


@dataclass
class SlotScan:
    """Values in the scanned slots that no correct write produces."""

    slots: int = 0  # slots scanned
    nonfinite: int = 0  # slots with a NaN/Inf K or V value (fp8 NaN codes included)
    bad_scales: int = 0  # per-token-head scales not finite, or <= 0 where the slot holds nonzero codes
    first: dict = field(default_factory=dict)  # {tensor, block, offset} of the first bad slot
    state_blocks: int = 0  # blocks of the scanned slots that held states (hybrid models): their states scanned
    state_nonfinite: int = 0  # of those, blocks with a NaN/Inf in any state tensor

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.bad_scales == 0 and self.state_nonfinite == 0

    @classmethod
    def merged(cls, scans: list[dict]) -> SlotScan:
        """One scan of the whole cache from its processes' (each its shard, as a dict: slots count once per shard),
        with the first bad slot any of them found."""
        out = cls()
        for s in scans:
            for key in ("slots", "nonfinite", "bad_scales", "state_blocks", "state_nonfinite"):
                setattr(out, key, getattr(out, key) + s[key])
            out.first = out.first or s["first"]
        return out


def scan_slots(view, slots, blocks=()) -> SlotScan:
    """NaN/Inf in k/v and bad scale values, over ``slots`` (an int64 tensor); a slot counts once
    however many layers are bad there. Slots of a block last handed to a state group are not read as K/V: that
    block's states are scanned instead (``_scan_states``), as are those of ``blocks`` (block ids whose states
    changed) that a state group holds."""
    import torch

    scan = SlotScan(slots=int(len(slots)))
    if getattr(view, "states", None):
        slots = _scan_states(view, slots, scan, torch.as_tensor(blocks, dtype=torch.int64))
    if len(slots) == 0:
        return scan
    num_slots = view.num_blocks * view.block_size
    bad = {k: torch.zeros(len(slots), dtype=torch.bool) for k in ("nonfinite", "bad_scales")}
    for i, layer in enumerate(view.layers):
        for kind in ("k", "v"):
            codes = getattr(layer, kind).reshape(num_slots, -1)
            scales = getattr(layer, f"{kind}_scale", None)
            scales = scales.reshape(num_slots, -1) if scales is not None else None
            for a, b in _chunks(len(slots), codes.shape[1] * 8):
                sel = slots[a:b].to(codes.device)
                c = codes[sel].float()
                _mark(scan, bad["nonfinite"], a, ~torch.isfinite(c).all(1), f"{i}.{kind}", sel, view.block_size)
                if scales is not None:
                    s = scales[sel]
                    wrong = ~torch.isfinite(s).all(1) | ((c != 0).any(1) & (s <= 0).any(1))
                    _mark(scan, bad["bad_scales"], a, wrong, f"{i}.{kind}_scale", sel, view.block_size)
    scan.nonfinite, scan.bad_scales = int(bad["nonfinite"].sum()), int(bad["bad_scales"].sum())
    return scan


def _scan_states(view, slots, scan: SlotScan, changed):
    """Scan the state tensors of the blocks of ``slots`` and of ``changed`` that held states; returns the other
    slots (K/V)."""
    import torch

    owned = torch.as_tensor(sorted(view.state_blocks()), dtype=torch.int64)
    is_state = torch.isin(slots // view.block_size, owned)
    blocks = torch.unique(torch.cat([slots[is_state] // view.block_size, changed[torch.isin(changed, owned)]]))
    scan.state_blocks = int(len(blocks))
    bad = torch.zeros(len(blocks), dtype=torch.bool)
    for name, t in state_tensors(view) if len(blocks) else ():
        wrong = (~torch.isfinite(t[blocks.to(t.device)].reshape(len(blocks), -1).float())).any(1).cpu()
        if wrong.any() and not scan.first:
            scan.first = {"tensor": name, "block": int(blocks[int(wrong.nonzero()[0, 0])])}
        bad |= wrong
    scan.state_nonfinite = int(bad.sum())
    return slots[~is_state]


def _mark(scan: SlotScan, mask, start: int, bad, tensor: str, sel, block_size: int) -> None:
    """OR ``bad`` into ``mask[start:]``; remember the first bad slot seen."""
    bad = bad.cpu()
    mask[start:start + len(bad)] |= bad
    if bad.any() and not scan.first:
        slot = int(sel[int(bad.nonzero()[0, 0])])
        scan.first = {"tensor": tensor, "block": slot // block_size, "offset": slot % block_size}
