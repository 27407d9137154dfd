"""kvdiag.models.gen: the byte tokenizer and random-weight checkpoints that tests and benchmarks build on."""

import os
import string

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvdiag.models import gen as modelgen  # noqa: E402

TEXTS = [
    "",
    "a",
    "fqza=7261 kmbt=0932 ; kmbt=",
    string.printable,
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "".join(chr(c) for c in range(128)),
]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_ascii(text):
    tok = modelgen.byte_tokenizer()
    ids = tok(text).input_ids
    assert ids == [modelgen.BOS_ID] + list(text.encode())  # id = byte value, <s> first
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok(text, add_special_tokens=False).input_ids == list(text.encode())


def test_byte_tokenizer_specials():
    tok = modelgen.byte_tokenizer()
    assert len(tok) == modelgen.BYTE_VOCAB_SIZE == 259
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert tok.convert_ids_to_tokens(list(b"a=1")) == ["a", "=", "1"]


def test_saved_tokenizer_loads_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    modelgen.save_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "kmbt=0932 " + string.punctuation
    assert tok(text).input_ids == [256] + list(text.encode())
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert tok.eos_token_id == 257 and tok.pad_token_id == 258


@pytest.mark.parametrize("arch", modelgen.ARCHS)
def test_random_model_loads_and_gives_finite_logits(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # explicit head_dim larger than hidden/heads, GQA
    path = modelgen.make_random_model(tmp_path, arch, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                      head_dim=64, intermediate_size=96, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert model.config.head_dim == 64 and model.config.num_key_value_heads == 1
    names = set(model.state_dict())
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")
    ids = tok("fqza=7261 kmbt=0932 ; kmbt=", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], modelgen.BYTE_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not degenerate


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_random_model_dtype(tmp_path, dtype):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = modelgen.make_random_model(tmp_path, "llama", dtype=dtype, tie_word_embeddings=True, vocab_size=320)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, dtype)}
        assert "lm_head.weight" not in f.keys()
    assert str(AutoConfig.from_pretrained(path).dtype).endswith(dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.dtype == getattr(torch, dtype) and model.config.vocab_size == 320
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_random_model_is_deterministic_from_seed(tmp_path):
    from safetensors.torch import load_file

    a = load_file(str(modelgen.make_random_model(tmp_path / "a", "qwen3", seed=5) / "model.safetensors"))
    b = load_file(str(modelgen.make_random_model(tmp_path / "b", "qwen3", seed=5) / "model.safetensors"))
    c = load_file(str(modelgen.make_random_model(tmp_path / "c", "qwen3", seed=6) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        modelgen.make_random_model(tmp_path, "gpt2")


def test_qwen2_05b_shape():
    from transformers import AutoModelForCausalLM

    kw = dict(modelgen.QWEN2_05B)
    arch = kw.pop("arch")
    cfg = modelgen._config(arch, hidden_size=kw["hidden_size"], num_hidden_layers=kw["num_layers"],
                           num_attention_heads=kw["num_heads"], num_key_value_heads=kw["num_kv_heads"],
                           head_dim=kw["head_dim"], intermediate_size=kw["intermediate_size"],
                           vocab_size=kw["vocab_size"], tie_word_embeddings=kw["tie_word_embeddings"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 0.3e9 < n < 0.6e9
    assert cfg.num_attention_heads * cfg.head_dim == cfg.hidden_size == 896


def test_llama_31_8b_preset_has_the_published_parameter_count_and_rope():
    """Llama-3.1-8B has 8,030,261,248 parameters (its model card's safetensors total); the preset's config, built on
    the meta device, has the same."""
    from transformers import AutoModelForCausalLM

    kw = dict(modelgen.LLAMA31_8B)
    cfg = modelgen._config(kw["arch"], hidden_size=kw["hidden_size"], num_hidden_layers=kw["num_layers"],
                           num_attention_heads=kw["num_heads"], num_key_value_heads=kw["num_kv_heads"],
                           head_dim=kw["head_dim"], intermediate_size=kw["intermediate_size"],
                           vocab_size=kw["vocab_size"], tie_word_embeddings=kw["tie_word_embeddings"],
                           rope_scaling=kw["rope_scaling"], rope_theta=kw["rope_theta"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert modelgen.PRESETS["llama-3.1-8b"] is modelgen.LLAMA31_8B


def test_a_preset_is_written_from_the_command_line(tmp_path, monkeypatch):
    """`python -m kvdiag.models.gen PRESET OUT` (the 8B preset, shrunk here to two thin layers) loads in transformers,
    and the builtin engine reads its llama3 rope scaling."""
    from transformers import AutoModelForCausalLM

    from kvdiag.engines.builtin.config import ModelConfig

    small = {**modelgen.LLAMA31_8B, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 512}
    monkeypatch.setitem(modelgen.PRESETS, "llama-3.1-8b", small)
    modelgen.main(["llama-3.1-8b", str(tmp_path / "m")])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.rope_scaling["rope_type"] == "llama3" and model.config.num_hidden_layers == 2
    assert model.dtype == torch.bfloat16
    assert ModelConfig.from_path(tmp_path / "m").rope_scaling["factor"] == 8.0
