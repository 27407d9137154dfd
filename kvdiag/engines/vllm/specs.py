"""Each cache layer's kind, read from vLLM's own KV cache spec of that layer (``vllm.v1.kv_cache_interface``:
FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, MambaSpec ...; the model runner's ``get_kv_cache_spec()``),
as the layer dicts of kvdiag's storage audit (``kvdiag/checks/sweep/storage_audit.py``). Spec classes are matched by
name along their class hierarchy, most specific first, so a vLLM that lacks one of them still loads this module.
"""

from __future__ import annotations

import re

# (spec class name, the audit's kind), most specific first: SlidingWindowMLASpec is a SlidingWindowSpec,
# MLAAttentionSpec and SinkFullAttentionSpec are FullAttentionSpecs
KINDS = (("SlidingWindowMLASpec", "sliding mla"), ("MLAAttentionSpec", "mla"), ("SinkFullAttentionSpec", "full+sinks"),
         ("SlidingWindowSpec", "sliding"), ("ChunkedLocalAttentionSpec", "chunked local"),
         ("CrossAttentionSpec", "cross"), ("EncoderOnlyAttentionSpec", "encoder-only"), ("MambaSpec", "mamba"),
         ("FullAttentionSpec", "full"))


def kind_of(spec) -> str:
    """The audit's kind of a vLLM spec; an unknown spec class: its own name."""
    names = [c.__name__ for c in type(spec).__mro__]
    return next((kind for cls, kind in KINDS if cls in names), type(spec).__name__)


def _dtype_name(dtype, module) -> str:
    """The element dtype's name; vLLM keeps fp8 caches as uint8: the layer's kv_cache_dtype says which fp8."""
    name = str(dtype).removeprefix("torch.")
    cache_dtype = str(getattr(module, "kv_cache_dtype", "") or "")
    if name == "uint8" and cache_dtype.startswith("fp8"):
        return {"fp8": "fp8_e4m3"}.get(cache_dtype, cache_dtype)
    return name


def mamba_state_bytes(spec) -> int:
    """A Mamba layer's state bytes per sequence, without the padding that makes its page an attention page's size:
    ``real_page_size_bytes`` where vLLM has it (0.32), else the states' own sum (vLLM 0.24's MambaSpec has only the
    padded ``page_size_bytes``)."""
    import math

    real = getattr(spec, "real_page_size_bytes", None)
    if real is not None:
        return int(real)
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes))


def layer_dict(spec, module=None) -> dict:
    """One layer's audit dict from its vLLM spec (and its attention module, for kv_cache_dtype and MLA's ranks)."""
    kind = kind_of(spec)
    if kind == "mamba":
        mamba_type = getattr(spec, "mamba_type", None)
        detail = str(getattr(mamba_type, "name", mamba_type) or "").lower() or None
        return {"kind": kind, "dtype": "/".join(_dtype_name(d, None) for d in spec.dtypes), "detail": detail,
                "bytes_per_sequence": mamba_state_bytes(spec)}
    row = {"kind": kind, "dtype": _dtype_name(getattr(spec, "dtype", None), module),
           "bytes_per_token": int(spec.real_page_size_bytes) // int(spec.block_size)}
    if getattr(spec, "sliding_window", None) and "sliding" in kind:
        row["window"] = int(spec.sliding_window)
    if kind == "chunked local":
        row["window"] = int(spec.attention_chunk_size)
    if "mla" in kind:
        latent = getattr(module, "kv_lora_rank", None)
        rope = getattr(module, "qk_rope_head_dim", None)
        if latent is None or rope is None:  # the module does not say: the latent is the whole head
            latent, rope = int(spec.head_size), None
        row.update(latent=int(latent), rope=None if rope is None else int(rope))
    if kind == "full+sinks" and getattr(spec, "sink_len", None):
        row["detail"] = f"{spec.sink_len} sinks"
    return row


def _order(name: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", name)]


def layer_specs(runner) -> list[dict]:
    """Every cache layer of the model runner, in layer order, as audit dicts (with ``name``)."""
    ctx = runner.vllm_config.compilation_config.static_forward_context
    specs = runner.get_kv_cache_spec()
    return [{"name": name, **layer_dict(spec, ctx.get(name))} for name, spec in sorted(specs.items(),
                                                                                        key=lambda x: _order(x[0]))]
