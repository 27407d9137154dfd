"""Pick the kernel for the tensors' device: Triton on CUDA, the torch reference elsewhere.

The engine calls only these three functions. Their signatures are exactly those of
:mod:`kvdiag.kernels.reference`; the Triton modules (``kvdiag.kernels.store``,
``.attention``, ``.zero``) export functions of the same names and signatures.
On CPU, ``paged_attention`` runs :mod:`kvdiag.kernels.cpu_attention` (torch SDPA over
the same cache; backend ``"cpu"``); store and zero run the reference.

``KVDIAG_KERNELS=reference`` forces the reference everywhere; ``KVDIAG_KERNELS=triton``
makes a missing Triton module an error instead of a silent fallback.
A Triton module that does not exist yet (or cannot import triton) falls back to the
reference.
"""

from __future__ import annotations

import importlib
import os

from kvdiag.kernels import reference

_TRITON_MODULES = {"store_kv": "store", "paged_attention": "attention", "zero_blocks": "zero"}
_CPU_MODULES = {"paged_attention": "cpu_attention"}
_loaded: dict[str, object] = {}  # function name -> Triton function, or None when unavailable


def _triton(fn: str):
    if fn not in _loaded:
        try:
            module = importlib.import_module(f"kvdiag.kernels.{_TRITON_MODULES[fn]}")
            _loaded[fn] = getattr(module, fn)
        except (ImportError, AttributeError):
            if os.environ.get("KVDIAG_KERNELS") == "triton":
                raise
            _loaded[fn] = None
    return _loaded[fn]


def backend(fn: str, device) -> str:
    """``"triton"``, ``"cpu"`` or ``"reference"``: what :func:`store_kv` & co. use for tensors on ``device``."""
    if os.environ.get("KVDIAG_KERNELS") == "reference":
        return "reference"
    if getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return "cpu" if fn in _CPU_MODULES else "reference"
    return "triton" if _triton(fn) is not None else "reference"


def _pick(fn: str, device):
    kind = backend(fn, device)
    if kind == "triton":
        return _triton(fn)
    if kind == "cpu":
        return getattr(importlib.import_module(f"kvdiag.kernels.{_CPU_MODULES[fn]}"), fn)
    return getattr(reference, fn)


def store_kv(key, value, k_cache, v_cache, slot_mapping, kv_dtype, k_scale=1.0, v_scale=1.0,
             k_scale_cache=None, v_scale_cache=None) -> None:
    """See :func:`kvdiag.kernels.reference.store_kv`."""
    _pick("store_kv", k_cache.device)(key, value, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale,
                                      k_scale_cache, v_scale_cache)


def paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, kv_dtype="auto",
                    k_scale=1.0, v_scale=1.0, k_scale_cache=None, v_scale_cache=None, whole_page_reads=False,
                    split_tokens=None):
    """See :func:`kvdiag.kernels.reference.paged_attention`. ``split_tokens`` (the Triton kernel's; the
    reference and the CPU path have no splits): decode splits of a fixed length, so results do not depend on
    the batch."""
    fn = _pick("paged_attention", query.device)
    extra = {"split_tokens": split_tokens} if split_tokens and backend("paged_attention", query.device) == "triton" \
        else {}
    return fn(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, kv_dtype, k_scale, v_scale,
              k_scale_cache, v_scale_cache, whole_page_reads, **extra)


def zero_blocks(block_ids, tensors) -> None:
    """See :func:`kvdiag.kernels.reference.zero_blocks`."""
    tensors = [t for t in tensors if t is not None]
    if tensors:
        _pick("zero_blocks", tensors[0].device)(block_ids, tensors)
