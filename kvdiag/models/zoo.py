"""The model zoo: small checkpoints of the architectures users run, named on the command line as ``zoo:NAME``.

Each preset is one architecture family at tiny-llama's size (4 layers, hidden 256), with the shipped byte
tokenizer (vocabulary 259), so that ``scripts/train_tiny_model.py --arch NAME`` trains it on kvdiag's recall tasks
as it trains the shipped model. ``zoo:NAME`` resolves (``resolve``) to, in this order: a trained folder shipped in
``kvdiag/assets/zoo/NAME``; the folder built earlier in the zoo cache (``$KVDIAG_ZOO_DIR``, else
``~/.cache/kvdiag/zoo``); else it builds it there now (``build``): random weights from the preset's config, or, for
``llama`` and ``llama-outlier``, the shipped trained tiny-llama (the latter with ``add_k_outliers`` applied). A
random-weight build lives in ``NAME-random``, so that its case ids and reports say so; a trained model put in the
cache as ``NAME`` (``train_tiny_model.py --arch NAME --out CACHE/NAME``) is taken first.
docs/zoo.md lists the presets and what the builtin engine does with each.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdiag.errors import UserError

PREFIX = "zoo:"
MARKER = "zoo.json"  # written last into a built folder: what it is (name, trained or random, transform)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OUTLIER_FACTOR = 64  # a power of two: the K channels x64 and their Q channels /64 are exact in bf16
OUTLIER_PAIRS = 2  # rotary pairs per KV head made large: the lowest-frequency ones


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str
    feature: str  # the family feature the preset is in the zoo for
    config: dict[str, Any]  # the transformers config's keys at the training size
    tiny: dict[str, Any] = field(default_factory=dict)  # overrides for a CPU test's few-layer model
    from_shipped: bool = False  # built from the shipped trained tiny-llama instead of random weights
    outliers: bool = False  # add_k_outliers after training / when built
    recipe: dict[str, Any] = field(default_factory=dict)  # scripts/train_tiny_model.py defaults it changes
    warm_from_llama: bool = False  # training starts from tiny-llama's layers, state layers inserted (zoo_warm.py)


_ALT = ["sliding_attention", "full_attention"]
_SIZE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=384)
_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=128)
_LLAMA = dict(_SIZE, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
PRESETS = {p.name: p for p in (
    Preset("llama", "llama", "the shipped tiny-llama (GQA, no QK-norm)", _LLAMA, dict(head_dim=32),
           from_shipped=True),
    Preset("llama-outlier", "llama", f"no QK-norm, {OUTLIER_PAIRS} rotary pairs of K per KV head x{OUTLIER_FACTOR}",
           _LLAMA, dict(head_dim=32), from_shipped=True, outliers=True),
    Preset("qwen3", "qwen3", "QK-norm, head_dim 128, GQA",
           dict(_SIZE, head_dim=128, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None,
                use_sliding_window=False)),
    Preset("gemma3", "gemma3_text", "sliding-window (64 tokens) and global layers alternating, head_dim 256",
           # positions up to 8192: trained on at most 2k tokens, its band (a loss a dtype can add to) lies past them
           dict(_SIZE, head_dim=256, sliding_window=64, layer_types=_ALT * 2, query_pre_attn_scalar=256,
                max_position_embeddings=8192),
           dict(layer_types=_ALT), recipe=dict(steps=4000)),  # 1300 steps did not teach recall (docs/zoo.md)
    Preset("deepseek-v2", "deepseek_v2", "MLA: a latent KV of 512 (kv_lora_rank) + a 64-wide rope key per token, "
           "shared by the 4 heads; DeepSeek-V2's head dims (q/k 128 + 64, v 128)",
           dict(_SIZE, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=4, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False),
           dict(num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                first_k_dense_replace=2, moe_intermediate_size=32),
           # 6000 steps: see gemma3. Seed 1: the shipped run's; GPU training is not bit-reproducible, and seed 1234
           # learned in one run and not in two (docs/zoo.md)
           recipe=dict(steps=6000, seed=1)),
    Preset("granite-hybrid", "granitemoehybrid", "hybrid: Mamba-2 layers 0 and 3 (state, no KV), attention layers 1, "
           "2, 4, 5 (tiny-llama's, fine-tuned with the Mamba layers), dense MLPs",
           dict(_SIZE, num_hidden_layers=6, layer_types=["mamba", "attention", "attention"] * 2, num_local_experts=0,
                shared_intermediate_size=384, attention_multiplier=0.125, rms_norm_eps=1e-5,
                mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_d_conv=4,
                mamba_expand=2, mamba_chunk_size=256, position_embedding_type="rope", rope_theta=10000.0,
                tie_word_embeddings=False),
           dict(layer_types=["mamba", "attention"], shared_intermediate_size=128, mamba_n_heads=4, mamba_d_head=32,
                mamba_d_state=16),
           warm_from_llama=True, recipe=dict(steps=300, lr=3e-4, warmup=20, start_pairs=100, min_pairs=16,
                                             tokens_per_batch=4096, eval_every=100)),
    Preset("gpt-oss", "gpt_oss", "attention sinks, sliding (64) and full layers alternating, MoE (4 experts)",
           dict(_SIZE, head_dim=64, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=64, layer_types=_ALT * 2, tie_word_embeddings=False,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}),
           dict(head_dim=32, intermediate_size=64, layer_types=_ALT)),
)}


def names() -> list[str]:
    return list(PRESETS)


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserError(f"unknown zoo model '{name}'; the zoo has: {', '.join(PRESETS)}")
    return PRESETS[name]


def hf_config(name: str, *, tiny: bool = False, **overrides: Any):
    """The transformers config of preset ``name`` (``tiny``: its CPU-test size), ``overrides`` applied last."""
    import transformers

    from kvdiag.models import gen as modelgen

    p = preset(name)
    keys = dict(vocab_size=modelgen.BYTE_VOCAB_SIZE, max_position_embeddings=2048, initializer_range=0.02,
                bos_token_id=modelgen.BOS_ID, eos_token_id=modelgen.EOS_ID, pad_token_id=modelgen.PAD_ID)
    keys.update(p.config)
    if tiny:
        keys.update(_TINY)
        keys.update(p.tiny)
    keys.update({k: v for k, v in overrides.items() if v is not None})
    cfg = transformers.AutoConfig.for_model(p.model_type, **keys)
    cfg.architectures = [_causal_lm_class(cfg)]
    return cfg


def _causal_lm_class(cfg) -> str:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(cfg)].__name__


def zoo_cache() -> Path:
    env = os.environ
    if env.get("KVDIAG_ZOO_DIR"):
        return Path(env["KVDIAG_ZOO_DIR"]).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "kvdiag" / "zoo"


def shipped_dir(name: str) -> Path:
    from kvdiag.assets import ASSETS_DIR, TINY_MODEL

    return TINY_MODEL if name == "llama" else ASSETS_DIR / "zoo" / name


def is_zoo(model: str) -> bool:
    return model.startswith(PREFIX)


def resolve(model: str) -> Path:
    """``zoo:NAME`` -> its folder: shipped, else trained in the zoo cache (``NAME``), else the random-weight build
    (``NAME-random``, built now if missing). An unknown name is a UserError listing the zoo."""
    name = model[len(PREFIX):]
    p = preset(name)
    for folder in (shipped_dir(name), zoo_cache() / name):
        if (folder / "config.json").is_file() and not _stale(folder, name):
            return folder
    folder = zoo_cache() / name if p.from_shipped else zoo_cache() / f"{name}-random"
    if not (folder / "config.json").is_file() or _stale(folder, name):
        try:
            build(name, folder)
        except OSError as e:
            raise UserError(f"cannot build zoo model '{name}' in {folder}: {e.strerror or e}") from None
    return folder


def _stale(folder: Path, name: str) -> bool:
    """A folder that ``build`` wrote from an older preset (a trained or hand-made folder never is)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("built") is True and marker.get("preset") != digest(name)


def build(name: str, out: str | Path, *, seed: int = 0, tiny: bool = False) -> Path:
    """Write preset ``name``'s checkpoint to ``out`` (replaced whole, atomically): the shipped tiny-llama for
    ``llama``/``llama-outlier`` (unless ``tiny``), else random weights (transformers' init, ``seed``), in bf16."""
    from transformers.utils import logging as hf_logging

    p = preset(name)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr, where a refusal's one line goes
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        if p.from_shipped and not tiny:
            for f in shipped_dir("llama").iterdir():
                if f.is_file() and f.name != "README.md":
                    shutil.copy2(f, tmp / f.name)
            trained = True
        else:
            save_checkpoint(random_model(name, seed=seed, tiny=tiny), tmp)
            trained = False
        if p.outliers:
            add_k_outliers(tmp)
        write_marker(tmp, name, built=True, trained=trained, seed=None if trained else seed)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()
    return out


def random_model(name: str, *, seed: int = 0, tiny: bool = False, **overrides: Any):
    """Preset ``name`` as a transformers model with transformers' random init (float32, CPU; SDPA attention
    where transformers has it for the family, eager otherwise: gpt-oss's sinks)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(name, tiny=tiny, **overrides), dtype=torch.float32)


def save_checkpoint(model, out: str | Path) -> Path:
    """``model`` in bfloat16 with the shipped tokenizer, a greedy generation config and the legacy config keys
    transformers 4.x reads (what train_tiny_model.py and ``build`` write)."""
    import torch

    from kvdiag.models import gen as modelgen

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16).cpu()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    modelgen.add_legacy_config_keys(out)
    for f in TOKENIZER_FILES:
        shutil.copy2(shipped_dir("llama") / f, out / f)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = model.config.max_position_embeddings
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"bos_token_id": modelgen.BOS_ID, "eos_token_id": modelgen.EOS_ID, "pad_token_id": modelgen.PAD_ID,
               "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return out


def digest(name: str) -> str:
    """A short hash of preset ``name`` (its model type and config), kept in ``zoo.json``: a cached build of an older
    preset is built again."""
    import hashlib

    p = preset(name)
    text = json.dumps([p.model_type, p.config, p.from_shipped, p.outliers, OUTLIER_FACTOR, OUTLIER_PAIRS],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def write_marker(folder: str | Path, name: str, **info: Any) -> None:
    data = {"name": name, "model_type": preset(name).model_type, "feature": preset(name).feature,
            "preset": digest(name), **info}
    (Path(folder) / MARKER).write_text(json.dumps(data, indent=1) + "\n")


def add_k_outliers(folder: str | Path, factor: int = OUTLIER_FACTOR, pairs: int = OUTLIER_PAIRS) -> list[int]:
    """Give every layer's K projection a few large-magnitude channels without changing the model's function.

    In each KV head, the ``pairs`` lowest-frequency rotary pairs (channels i and i + head_dim/2, i = head_dim/2 - 1,
    ...) of ``k_proj`` are multiplied by ``factor`` and the same channels of every query head of its group in
    ``q_proj`` divided by it: RoPE rotates each pair as a whole, so every q.k product, and with a power-of-two
    factor every bf16 weight, stays exact; the attention scores and the model's outputs are unchanged, while the
    keys the KV cache stores get channels ~factor x larger than the rest (the shape of Qwen2.5's K, no QK-norm).
    Rewrites ``model.safetensors`` in place; returns the channels of one head that were scaled."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    half = head_dim // 2
    chans = sorted(c for i in range(half - pairs, half) for c in (i, i + half))
    file = folder / "model.safetensors"
    state = load_file(str(file))
    if any(".k_norm." in n for n in state):
        raise ValueError(f"{folder}: its K projections are followed by a QK-norm, which would undo the outliers")
    with torch.no_grad():
        for name in [n for n in state if ".k_proj." in n]:
            q_name = name.replace(".k_proj.", ".q_proj.")
            k, q = state[name].clone(), state[q_name].clone()
            for h in range(kv_heads):
                k[[h * head_dim + c for c in chans]] *= factor
            for h in range(heads):
                q[[h * head_dim + c for c in chans]] /= factor
            state[name], state[q_name] = k, q
    save_file(state, str(file), metadata={"format": "pt"})
    return chans


def main(argv: list[str] | None = None) -> None:
    """``python -m kvdiag.models.zoo NAME OUT [--seed N]``: write zoo model NAME's checkpoint to OUT (random weights;
    ``llama`` and ``llama-outlier``: the shipped trained weights)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvdiag.models.zoo", description=main.__doc__)
    ap.add_argument("name", choices=names())
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(build(a.name, a.out, seed=a.seed))


if __name__ == "__main__":
    main()
