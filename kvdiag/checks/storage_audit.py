"""The storage audit of `kvdiag dtypes --check`: what each kind of layer of an engine's cache stores.

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
