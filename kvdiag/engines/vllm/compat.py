"""Shims for an installed vLLM that cannot build a checkpoint the way the installed transformers reads it.

Each shim is decided from the installed vLLM's own code (its source, read without importing it) and the names the
installed transformers gives the config, passes vLLM an ``hf_overrides`` engine argument, and is said in the case's
record (an info finding ``vllm_transformers_mismatch``, through ``kvdiag.case.engine_note``). A ``-a hf_overrides=``
of the user's replaces it. docs/vllm-findings.md lists the vLLM failures behind them.

- GraniteMoeHybrid layer names: transformers 5 renames a config's ``layer_types`` on load ("mamba" ->
  "linear_attention", "attention" -> "full_attention", ``configuration_utils._LEGACY_LAYER_TYPE_REMAP``); vLLM 0.24's
  ``granitemoehybrid.py`` keys its layer table (``ALL_DECODER_LAYER_TYPES``) by the old names and fails with
  ``KeyError: 'linear_attention'``. vLLM applies ``hf_overrides`` to the config transformers loaded
  (``transformers_utils/config.py``: ``config.update``), so the old names given back there reach the model.
"""

from __future__ import annotations

from kvdiag.models import config

GRANITE_MODEL_TYPE = "granitemoehybrid"
GRANITE_SOURCE = ("model_executor", "models", "granitemoehybrid.py")  # under the installed vllm package
LAYER_TABLE = "ALL_DECODER_LAYER_TYPES"
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}  # old -> new, transformers 5's
MISMATCH = "vllm_transformers_mismatch"  # the finding's kind


def table_keys(tree, name: str = LAYER_TABLE) -> set[str] | None:
    """The string keys of the module-level dict ``name = {...}`` in a module's ast; None when there is none."""
    import ast

    from kvdiag.engines.vllm.source import top_assign

    value = top_assign(tree, name)
    if not isinstance(value, ast.Dict):
        return None
    return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)} or None


def transformers_remap() -> dict[str, str]:
    """The layer-type renames the installed transformers applies on load (old -> new); {} when it renames none."""
    try:
        from transformers import configuration_utils
    except ImportError:
        return {}
    return dict(getattr(configuration_utils, "_LEGACY_LAYER_TYPE_REMAP", None) or {})


def layer_types_for_vllm(table: set[str], on_disk: list[str], remap: dict[str, str]) -> list[str] | None:
    """The ``layer_types`` vLLM must be given so that every entry is a key of its layer ``table``: what transformers
    loads (``on_disk`` renamed by ``remap``), each name the table lacks replaced by the other name of its pair
    (``remap`` and LEGACY_LAYER_TYPES, either way). None when transformers' names already are the table's (or no
    other name is)."""
    loaded = [remap.get(t, t) for t in on_disk]
    pairs = {**LEGACY_LAYER_TYPES, **remap}.items()

    def named(t: str) -> str:  # several old names may map to one new one (transformers 5.17: conv and mamba)
        others = [old for old, new in pairs if new == t] + [new for old, new in pairs if old == t]
        return t if t in table else next((o for o in others if o in table), t)

    out = [named(t) for t in loaded]
    return out if out != loaded else None


def granite_layer_types(model: str, read_source) -> tuple[dict, str] | None:
    """(``hf_overrides``, the note saying why) when the installed vLLM cannot build the GraniteMoeHybrid checkpoint
    ``model`` (a folder) with the layer names transformers gives it; else None. ``read_source(*parts)``: the ast of
    a module of the installed vLLM (``source.vllm_source``), read only for a GraniteMoeHybrid checkpoint."""
    cfg = config(model)
    on_disk = cfg.get("layer_types") or cfg.get("layers_block_type")
    if cfg.get("model_type") != GRANITE_MODEL_TYPE or not isinstance(on_disk, list):
        return None
    table, remap = table_keys(read_source(*GRANITE_SOURCE)), transformers_remap()
    wanted = layer_types_for_vllm(table or set(), on_disk, remap)
    if not table or wanted is None:
        return None
    loaded = sorted({remap.get(t, t) for t in on_disk})
    note = (f"vLLM/transformers mismatch: the installed transformers names GraniteMoeHybrid layers "
            f"{', '.join(loaded)} while this vLLM's granitemoehybrid.py keys {LAYER_TABLE} by "
            f"{', '.join(sorted(table))}; kvdiag passes hf_overrides layer_types={wanted} "
            "(docs/vllm-findings.md)")
    return {"layer_types": wanted}, note
