"""zoo:granite-hybrid starts from tiny-llama (models/zoo_warm.py): its inserted Mamba-2 layers are identities, so before
fine-tuning it computes exactly what transformers' Llama computes with the shipped weights, and a Mamba layer that
writes anything changes that."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvdiag.assets import TINY_MODEL  # noqa: E402
from kvdiag.models import gen as modelgen  # noqa: E402
from kvdiag.models import zoo, zoo_warm  # noqa: E402


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_the_warm_started_hybrid_is_tiny_llama_until_its_mamba_layers_write():
    llama = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    hybrid = zoo_warm.from_llama("granite-hybrid", seed=5)
    kinds = ["attn" if t in zoo_warm.ATTENTION else "state" for t in hybrid.config.layer_types]
    assert kinds.count("attn") == llama.config.num_hidden_layers and kinds.count("state") >= 2
    assert kinds[0] == "state" and "state" in kinds[1:-1]  # before the first attention layer and between two
    ids = torch.tensor([[modelgen.BOS_ID] + list(b"fqza=7261 kmbt=0932 qqrt=1180 ; kmbt=")] * 2)
    want = _logits(llama, ids)
    assert torch.allclose(_logits(hybrid, ids), want, atol=1e-5, rtol=0)
    i = kinds.index("state")
    with torch.no_grad():
        hybrid.model.layers[i].mamba.out_proj.weight.normal_(std=0.02)
    assert (_logits(hybrid, ids) - want).abs().max() > 1e-3  # the Mamba layer is in the forward path


def test_a_preset_whose_attention_layers_are_not_tiny_llamas_is_refused():
    llama_cfg = transformers.AutoConfig.from_pretrained(TINY_MODEL)
    assert zoo_warm.llama_layout_matches(zoo.hf_config("granite-hybrid"), llama_cfg)
    assert not zoo_warm.llama_layout_matches(zoo.hf_config("granite-hybrid", tiny=True), llama_cfg)
