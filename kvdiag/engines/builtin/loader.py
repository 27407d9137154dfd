"""Find a checkpoint, load its safetensors into :class:`CausalLM`, its tokenizer and its fp8 KV scales."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kvdiag.engines.builtin.config import ModelConfig
from kvdiag.engines.builtin.model import CausalLM
from kvdiag.errors import UserError

# checkpoint projection -> (packed module, shard index)
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# per-tensor fp8 KV scales: model.layers.N.self_attn.k_scale (also .attn.k_scale, k_proj.output_scale, kv_scale)
_SCALE = re.compile(r"^model\.layers\.(\d+)\..*?(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$")
_IGNORED = ("rotary_emb.inv_freq",)


def resolve_model_path(model: str) -> Path:
    """A local folder, else a hub id fetched (or found in the cache when HF_HUB_OFFLINE=1)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise UserError(f"model '{model}' is not a folder with a Hugging Face checkpoint nor a hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as e:  # noqa: BLE001 - offline, not found, no access: one clear line
        raise UserError(f"cannot get model '{model}' from the hub: {type(e).__name__}: {e}") from None


def _files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors weights in '{path}'")
    return files


def _tensors(path: Path, device: str):
    from safetensors import safe_open

    for file in _files(path):
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _shard_rows(cfg: ModelConfig, packed: str) -> list[int]:
    if packed == "qkv_proj":
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    return [cfg.intermediate_size, cfg.intermediate_size]


def build_model(cfg: ModelConfig, path: Path, dtype: torch.dtype, device: torch.device, max_len: int) -> CausalLM:
    """A :class:`CausalLM` on ``device`` in ``dtype`` holding the checkpoint's weights."""
    with torch.device(device):  # uninitialised storage (no random init, see model.Linear); not meta + to_empty,
        model = CausalLM(cfg, dtype, max_len)  # whose empty_like imports sympy (~0.5 s a process)
    model.rotary.build()
    params = dict(model.named_parameters())
    missing = set()
    for pname in params:
        module = pname.split(".")[-2]
        shards = 3 if module == "qkv_proj" else 2 if module == "gate_up_proj" else 0
        missing.update([f"{pname}#{i}" for i in range(shards)] if shards else [pname])
    dev = "cpu" if device.type == "cpu" else str(device)
    with torch.no_grad():
        for name, t in _tensors(path, dev):
            if name.endswith(_IGNORED) or _SCALE.match(name):
                continue
            if "weight_scale" in name or "input_scale" in name:
                raise UserError(f"'{path}' holds quantized weights ({name}); the builtin engine loads bf16/fp16/fp32")
            parts = name.split(".")
            shard = None
            if len(parts) >= 3 and parts[-2] in PACKED:
                packed, shard = PACKED[parts[-2]]
                parts[-2] = packed
                name = ".".join(parts)
            if name not in params:
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                raise UserError(f"unexpected tensor '{name}' in checkpoint '{path}'")
            p = params[name]
            if shard is None:
                p.copy_(t)
            else:
                rows = _shard_rows(cfg, parts[-2])
                p.narrow(0, sum(rows[:shard]), rows[shard]).copy_(t)
            missing.discard(name if shard is None else f"{name}#{shard}")
    if missing:
        raise UserError(f"checkpoint '{path}' lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    model.eval()
    return model


def load_kv_scales(path: Path, num_layers: int) -> tuple[list[float], list[float]] | None:
    """Per-layer (k_scales, v_scales) from the checkpoint, 1.0 where a layer has none; None if it has none."""
    from safetensors import safe_open

    k, v, found = [1.0] * num_layers, [1.0] * num_layers, False
    for file in _files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _SCALE.match(name)
                if not m:
                    continue
                layer, kind, value = int(m.group(1)), m.group(2), float(f.get_tensor(name).float().max())
                if kind in ("k_scale", "kv_scale", "k_proj.output_scale"):
                    k[layer] = value
                if kind in ("v_scale", "kv_scale", "v_proj.output_scale"):
                    v[layer] = value
                found = True
    return (k, v) if found else None


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer. A plain ``tokenizer.json`` one (``tokenizer_class`` PreTrainedTokenizerFast,
    as the shipped model's) goes through the ``tokenizers`` library itself (``tokenizer.plain``), else
    transformers' AutoTokenizer, whose import alone takes seconds on a small CPU."""
    from kvdiag.engines.builtin import tokenizer

    try:
        if (tok := tokenizer.plain(path)) is not None:
            return tok
        from kvdiag.models import hf_tokenizer

        return hf_tokenizer(path)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot load the tokenizer of '{path}': {type(e).__name__}: {e}") from None
