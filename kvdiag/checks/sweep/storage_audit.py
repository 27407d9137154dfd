"""The storage audit of `kvdiag dtypes --check` (and of each `kvdiag accuracy` case): what each kind of layer of an
engine's cache stores, and the ``not_quantized`` warning of a dtype named as quantized that stores layers at the
model's precision.

An engine describes each cache layer as a dict (its ``kv_layer_specs()``; vLLM: from its own KV cache spec of
each layer): ``kind`` (``full``, ``sliding``, ``mla``, ``sliding mla``, ``chunked local``, ``full+sinks``,
``mamba`` ...), ``dtype`` (the element dtype: ``bfloat16``, ``fp8_e4m3``, ``int8``, Mamba: one per state tensor,
``"/"``-joined), ``bytes_per_token`` (attention) or ``bytes_per_sequence`` (a state), and the kind's own numbers:
``window`` (sliding), ``latent`` and ``rope`` (MLA), ``detail`` (e.g. the Mamba type). The audit groups equal layers
into rows, each with its count. An engine without ``kv_layer_specs()`` (the builtin: full attention only) is
described from its ``kv_blocks()`` tensors.
"""

from __future__ import annotations

KEYS = ("kind", "dtype", "window", "latent", "rope", "detail", "bytes_per_token", "bytes_per_sequence")
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3",
         "float8_e5m2": "fp8_e5m2"}


def audit(layers: list[dict]) -> list[dict]:
    """Equal layers (same kind, dtype, shape numbers, bytes) as one row with ``count``, in first-seen order."""
    rows: dict[tuple, dict] = {}
    for layer in layers:
        key = tuple(layer.get(k) for k in KEYS)
        if key not in rows:
            rows[key] = {**{k: layer.get(k) for k in KEYS}, "count": 0}
        rows[key]["count"] += 1
    return list(rows.values())


def view_layers(view) -> list[dict]:
    """Full-attention layer dicts from a :class:`KVBlockView`'s tensors (K, V and per-token scales)."""
    from kvdiag.checks.kv_tensors import token_bytes

    out = []
    for layer in view.layers:
        names = [str(t.dtype).removeprefix("torch.") for t in (layer.k, layer.v)]
        tensors = [t for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
        scales = layer.k_scale is not None or layer.v_scale is not None
        out.append({"kind": "full", "dtype": (names[0] if names[0] == names[1] else "/".join(names))
                    + ("+scales" if scales else ""),
                    "bytes_per_token": sum(token_bytes(t, view) for t in tensors)})
    return out


def describe(row: dict) -> str:
    """One audit row as text, e.g. ``5 sliding(window 512) bf16 2048 B/token``, ``2 mamba(mamba2) fp32 4096
    B/sequence``."""
    extra = [f"window {row['window']}" if row.get("window") else "",
             f"latent {row['latent']} + rope {row['rope']}" if row.get("latent") is not None else "",
             row.get("detail") or ""]
    extra = ", ".join(x for x in extra if x)
    dtype = "/".join(SHORT.get(d, d) for d in str(row.get("dtype")).split("/"))
    size = (f"{row['bytes_per_token']} B/token" if row.get("bytes_per_token") is not None
            else f"{row['bytes_per_sequence']} B/sequence" if row.get("bytes_per_sequence") is not None else "? B")
    return f"{row['count']} {row['kind']}" + (f"({extra})" if extra else "") + f" {dtype} {size}"


def summary(rows: list[dict] | None) -> str | None:
    """The audit as one line: its rows' texts joined by ``; ``; None without an audit."""
    return "; ".join(describe(r) for r in rows) if rows else None


def cache_storage(engine) -> dict | None:
    """What the engine's cache stores: ``kv_tensors.storage_summary`` of its tensors and, as ``kinds``, the storage
    audit of its layer kinds (``audit``: the engine's ``kv_layer_specs()``, else its tensors as full
    attention); None when neither is known."""
    from kvdiag.checks import kv_where
    from kvdiag.checks.kv_tensors import storage_summary
    from kvdiag.errors import EngineUnsupported

    try:
        view = engine.kv_blocks()
    except (EngineUnsupported, NotImplementedError):
        view = None
    from kvdiag.engines.protocol import LayerSpecs

    layers = engine.kv_layer_specs() if isinstance(engine, LayerSpecs) else None
    if layers is None and view is not None:
        layers = view_layers(view)
    if view is None and kv_where.in_workers(engine):  # tensor parallelism: each worker's shard
        try:
            parts = kv_where.on_kv(engine, storage_summary)
        except Exception:  # noqa: BLE001 - a worker that cannot view its cache (as kv_blocks() None in one process)
            parts = None
        return {**(whole_summary(parts) if parts else {}), "kinds": audit(layers or [])}
    if view is None and not layers:
        return None
    st = storage_summary(view) if view is not None else {}
    return {**st, "kinds": audit(layers or [])}


def whole_summary(parts: list[dict]) -> dict:
    """The engine's ``storage_summary`` from its worker processes' (each holds a shard of every layer's heads): the
    bytes per token summed, the rest as each worker has it, and ``shards``."""
    out = dict(parts[0], shards=len(parts))
    for key in ("k_bytes_per_token", "v_bytes_per_token", "scale_bytes_per_token"):
        out[key] = sum(p[key] for p in parts)
    return out


def storage_row(rec) -> dict:
    """The row's storage columns: ``stores`` (e.g. ``int8 +scales``, ``bf16 (2/2 layers)``), ``layers`` (the storage
    audit: each layer kind, its count, element dtype and bytes per token or per sequence), ``kv_bytes_per_token``
    (K+V over all layers), ``scale_bytes_per_token``, ``storage`` (the case's summary) and ``not_quantized``
    (the warning when a dtype named as quantized stores layers at the model's precision, else None)."""
    from collections import Counter

    st = rec.metrics.get("storage")
    if not st:
        return {"stores": None, "layers": None, "kv_bytes_per_token": None, "scale_bytes_per_token": None,
                "storage": None, "not_quantized": None}
    layer_dtypes = st.get("layer_dtypes") or [k["dtype"] for k in st.get("kinds", []) for _ in range(k["count"])]
    n_layers = st.get("layers", len(layer_dtypes))
    full = _full_precision(rec.kv_dtype, layer_dtypes, st.get("element_bytes", {}), rec.metrics.get("model_dtype"))
    counts = Counter(layer_dtypes)
    names = {d: "/".join(SHORT.get(x, x) for x in d.split("/")) for d in counts}
    stores = ", ".join(names[d] if len(counts) == 1 and not full else f"{names[d]} ({c}/{n_layers} layers)"
                       for d, c in counts.items()) + (" +scales" if st.get("scales") else "")
    warn = None
    if full:
        warn = (f"'{rec.kv_dtype}' is named as quantized but stores {len(full)} of {n_layers} layers at the "
                f"model's precision ({', '.join(sorted(set(full)))})")
    kv = st["k_bytes_per_token"] + st["v_bytes_per_token"] if "k_bytes_per_token" in st else None
    return {"stores": stores, "layers": summary(st.get("kinds")), "kv_bytes_per_token": kv,
            "scale_bytes_per_token": st.get("scale_bytes_per_token"), "storage": st, "not_quantized": warn}


def _full_precision(kv_dtype: str, layer_dtypes: list[str], sizes: dict, model: str | None) -> list[str]:
    """The layers' dtypes that are the model's precision (its dtype, or as many bytes or more), when ``kv_dtype``
    is named as quantized; else []."""
    from kvdiag import dtypes

    if not dtypes.named_quantized(kv_dtype):
        return []
    model_bytes = dtypes.element_bytes(model) or 2

    def size(x: str) -> int:
        return sizes.get(x) or dtypes.element_bytes(x.removesuffix("+scales")) or 0
    return [d for d in layer_dtypes if any(x == model or size(x) >= model_bytes for x in d.split("/"))]
