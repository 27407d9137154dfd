"""Tiny tokenizers and random-weight checkpoints for tests, the self-test and benchmarks.

``byte_tokenizer()`` is a byte-level BPE tokenizer with no merges: token id N is
byte N, followed by ``<s>``, ``</s>`` and ``<pad>``. ``make_random_model()``
writes a random-weight Llama/Mistral/Qwen2/Qwen3 checkpoint that
``AutoModelForCausalLM.from_pretrained`` (and vLLM) load offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 259

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# ~0.5B-parameter Qwen2 shape (Qwen2.5-0.5B's hidden 896, 24 layers, 14 heads,
# 2 kv heads, intermediate 4864). The real model has a 151,936-token vocabulary;
# we keep the byte tokenizer (padded to 512 ids), so the embedding and LM head are
# tiny and the transformer blocks hold ~0.36B of the parameters (~0.5B with the
# real vocabulary). Attention/MLP/KV shapes, which is what KV benchmarks exercise,
# are the real ones.
QWEN2_05B: dict[str, Any] = dict(
    arch="qwen2",
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=4864,
    vocab_size=512,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    dtype="bfloat16",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer(model_max_length: int = 1 << 20):
    """A fast byte-level tokenizer: ids 0..255 are bytes, then <s>, </s>, <pad>; adds <s> first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A:0", pair="<s> $A:0 <s> $B:1", special_tokens=[("<s>", BOS_ID)]
    )
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("<pad>") == PAD_ID
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def save_tokenizer(path: str | Path, model_max_length: int = 1 << 20) -> None:
    """Save ``byte_tokenizer()`` to ``path`` (tokenizer.json + tokenizer_config.json)."""
    path = Path(path)
    byte_tokenizer(model_max_length=model_max_length).save_pretrained(path)
    # transformers 5 writes "TokenizersBackend", which transformers 4.x (e.g. under vLLM)
    # does not know; PreTrainedTokenizerFast loads the same tokenizer.json in both.
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def add_legacy_config_keys(path: str | Path) -> None:
    """Also write ``rope_theta`` and ``torch_dtype`` at the top of config.json.

    transformers 5 keeps them in ``rope_parameters`` / ``dtype``; transformers 4.x
    (which some vLLM builds use) reads the old keys. Both read the same values.
    """
    cfg_file = Path(path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope and rope.get("rope_type", "default") == "default":
        cfg.setdefault("rope_theta", rope["rope_theta"])
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _config(arch: str, **kw):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; accepted: {', '.join(ARCHS)}")
    return classes[arch](**kw)


def make_random_model(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    dtype: str = "float32",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    vocab_size: int | None = None,
    init_std: float = 0.05,
    device: str = "cpu",
    **extra_config: Any,
) -> Path:
    """Write a random-weight HF checkpoint (config, safetensors, tokenizer) to ``path``.

    Weights are N(0, init_std) (norm weights 1, biases N(0, init_std)), deterministic
    from ``seed`` on a given ``device`` (``cuda`` draws a multi-GB model in seconds). Returns ``path``.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, not {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if vocab_size is None:
        vocab_size = BYTE_VOCAB_SIZE
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {BYTE_VOCAB_SIZE}")
    if head_dim is None:
        head_dim = hidden_size // num_heads
    extra_config.setdefault("rms_norm_eps", 1e-5)
    if arch in ("mistral", "qwen2", "qwen3"):
        extra_config.setdefault("sliding_window", None)
    config = _config(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **extra_config,
    )
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]

    # Build on the meta device (instant), then fill every parameter ourselves.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    config.dtype = getattr(torch, dtype)  # after from_config, which overwrites it
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        if "norm" in name and name.endswith("weight"):
            t = torch.ones(p.shape, device=device)
        else:
            t = torch.randn(p.shape, generator=gen, device=device) * init_std
        state[name] = t.to(getattr(torch, dtype)).contiguous().cpu()
    if tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    add_legacy_config_keys(path)
    save_tokenizer(path, model_max_length=max_position_embeddings)
    gen_cfg = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return path


# Llama-3.1-8B's shapes (hidden 4096, 32 layers, 32 heads, 8 kv heads, 14336 MLP, 128,256 ids, llama3 rope), bf16:
# ~16 GB of random weights, for real-size runs of the builtin engine (BENCHMARKS.md, "Whole commands").
LLAMA31_8B: dict[str, Any] = dict(
    arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="bfloat16",
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192})
PRESETS = {"qwen2-0.5b": QWEN2_05B, "llama-3.1-8b": LLAMA31_8B}


def main(argv: list[str] | None = None) -> None:
    """``python -m kvdiag.models.gen PRESET OUT [--device cuda]``: write a preset's random-weight checkpoint."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvdiag.models.gen", description=main.__doc__)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu", help="where to draw the weights (cpu, cuda)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(make_random_model(a.out, seed=a.seed, device=a.device, **PRESETS[a.preset]))


if __name__ == "__main__":
    main()
