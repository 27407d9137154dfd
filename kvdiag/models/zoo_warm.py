"""A zoo preset warm-started from the shipped trained tiny-llama (``Preset.warm_from_llama``).

The hybrid preset keeps tiny-llama's four attention+MLP layers, in order, and inserts its state layers (Mamba-2)
between them as identities: their output projection and their MLP's output projection are zero, so the new model
computes tiny-llama's function exactly (``tests/unit/test_zoo_warm.py`` holds the two forwards to each other).
``scripts/train_tiny_model.py --arch granite-hybrid`` then fine-tunes the whole model on the recall tasks; Adam's
first steps move the zero projections as far as any other weight, so the state layers end up in the computation
(the training log records how much the model's answers change when they are zeroed again).
"""

from __future__ import annotations

from typing import Any

ATTENTION = ("attention", "full_attention")  # a layer_types entry of an attention layer (transformers 5 renames it)


def _llama_layer(sd: dict, i: int) -> dict[str, Any]:
    """tiny-llama layer ``i``'s weights under GraniteMoeHybrid's names (gate and up fused, gate first)."""
    import torch

    p = f"model.layers.{i}."
    out = {f"self_attn.{a}_proj.weight": sd[f"{p}self_attn.{a}_proj.weight"] for a in "qkvo"}
    out["input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
    out["post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    out["shared_mlp.input_linear.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
    out["shared_mlp.output_linear.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


def llama_layout_matches(cfg, llama_cfg) -> bool:
    attn = [t for t in cfg.layer_types if t in ATTENTION]
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings")
    return len(attn) == llama_cfg.num_hidden_layers and all(getattr(cfg, k) == getattr(llama_cfg, k) for k in keys)


def from_llama(name: str, *, seed: int = 0):
    """Preset ``name`` (a granitemoehybrid) with tiny-llama's layers in its attention slots and identity state
    layers (transformers' init for their other weights, ``seed``), float32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvdiag.assets import TINY_MODEL
    from kvdiag.models import zoo

    model = zoo.random_model(name, seed=seed)
    llama = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    if not llama_layout_matches(model.config, llama.config):
        raise ValueError(f"zoo preset {name}: its attention layers do not have tiny-llama's shapes")
    sd = llama.state_dict()
    state = {k: v for k, v in sd.items() if not k.startswith("model.layers.")}
    own = model.state_dict()
    src = iter(range(llama.config.num_hidden_layers))
    for i, kind in enumerate(model.config.layer_types):
        p = f"model.layers.{i}."
        if kind in ATTENTION:
            state.update({p + k: v for k, v in _llama_layer(sd, next(src)).items()})
        else:  # an identity: nothing it computes reaches the residual stream
            for k in ("mamba.out_proj.weight", "shared_mlp.output_linear.weight"):
                state[p + k] = torch.zeros_like(own[p + k])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(".mamba." not in k and ".shared_mlp." not in k and "norm" not in k for k in missing):
        raise ValueError(f"zoo preset {name}: tiny-llama's weights do not map onto it ({missing}, {unexpected})")
    return model
