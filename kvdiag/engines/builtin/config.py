"""The model configuration the builtin engine reads from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvdiag.errors import UserError
from kvdiag.models import sliding_window

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
# model types of the model zoo (kvdiag.models.zoo) and kin -> what the builtin engine lacks for them
LACKS = {
    "gemma2": "per-layer sliding windows, logit soft-capping, GeGLU and sandwich norms",
    "gemma3_text": "per-layer sliding windows and local rope, GeGLU and sandwich norms",
    "deepseek_v2": "MLA (a compressed latent KV cache)", "deepseek_v3": "MLA (a compressed latent KV cache)",
    "bamba": "Mamba-2 state layers", "falcon_h1": "Mamba-2 state layers", "granitemoehybrid": "Mamba-2 state layers",
    "nemotron_h": "Mamba-2 state layers", "zamba2": "Mamba-2 state layers",
    "gpt_oss": "attention sinks and MoE layers",
}


@dataclass
class ModelConfig:
    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # rope_type + its parameters; {} = default
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2; Llama/Qwen3 with attention_bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"  # the checkpoint's dtype
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        arch = cfg.get("model_type", "")
        if arch not in ARCHS:
            lacks = f" (it has no {LACKS[arch]})" if arch in LACKS else ""
            raise UserError(f"the builtin engine runs {', '.join(ARCHS)} models, not model_type '{arch}'{lacks}; "
                            "--engine vllm runs more")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UserError(f"the builtin engine supports hidden_act 'silu', not '{cfg['hidden_act']}'")
        if cfg.get("quantization_config"):
            raise UserError("the builtin engine does not load quantized weights (quantization_config is set)")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UserError(f"rope type '{rope_type}' is not supported by the builtin engine; "
                            f"supported: {', '.join(ROPE_TYPES)}")
        rope["rope_type"] = rope_type
        bias = bool(cfg.get("attention_bias", False))
        window = sliding_window(cfg)
        eos = cfg.get("eos_token_id")
        return cls(
            arch=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else {},
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            qkv_bias=True if arch == "qwen2" else bias,
            o_bias=False if arch in ("qwen2", "mistral") else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", ""),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise UserError(f"no config.json in model folder '{path}'")
        return cls.from_dict(json.loads(file.read_text()))
