"""--model: hub ids resolved once, offline, from a Hugging Face cache laid out by hand; model folders checked up
front (config keys, weights, safetensors headers, tokenizer) with one-line errors, exit 2, before any worker."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cpu_seconds import timed_run

from kvdiag.assets import TINY_MODEL
from kvdiag.checks.cases import resolve_model
from kvdiag.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors")


def snapshot(cache: Path, repo: str) -> Path:
    """``<cache>/models--org--name/snapshots/<sha>/`` linking the shipped model's files, and refs/main."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / SHA
    snap.mkdir(parents=True)
    for f in FILES:
        (snap / f).symlink_to(TINY_MODEL / f)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(SHA)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snaps = {repo: snapshot(cache, repo) for repo in ("org/name", "gpt2")}
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, snaps


def kvdiag(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout)


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdiag: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_hub_ids_resolve_to_their_cached_snapshot_offline(hub):
    _, snaps = hub
    assert resolve_model("org/name") == str(snaps["org/name"])
    assert resolve_model("gpt2") == str(snaps["gpt2"])  # a single-name hub id


def test_hf_home_locates_the_cache(tmp_path, monkeypatch):
    snap = snapshot(tmp_path / "home" / "hub", "org/name")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/name") == str(snap)


@pytest.mark.slow
def test_cli_runs_on_a_cached_hub_model(hub, tmp_path):
    cache, snaps = hub
    r = kvdiag("dtypes", "--check", "-e", "builtin", "-m", "org/name", "-d", "auto", "--format", "json",
               "-o", tmp_path / "run", env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    (case,) = json.loads(r.stdout)["cases"]
    assert case["status"] == "pass" and case["model"] == str(snaps["org/name"])
    assert case["id"] == "dtypes/builtin/name/auto"  # the repo's name, not the snapshot's commit hash


def test_an_uncached_hub_id_exits_2_in_seconds_offline_and_with_the_hub_unreachable(hub, tmp_path):
    cache, _ = hub
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    r, offline_cpu = timed_run([sys.executable, "-m", "kvdiag", "dtypes", "--check", "-m", "org/absent", "-d", "auto",
                                "-o", tmp_path / "a"], cwd=ROOT, env=env, timeout=120)
    offline_s = time.perf_counter() - t0
    one_line_error(r, "'org/absent'", str(cache), "HF_HUB_OFFLINE")
    assert offline_cpu < 15, offline_cpu  # CPU seconds: what a loaded machine does not stretch
    # online, but the hub accepts the connection and never answers: a short timeout, not a hang in every worker
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_ETAG_TIMEOUT="1",
               HF_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}", PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kvdiag", "dtypes", "--check", "-m", "org/absent", "-d", "auto",
                        "-o", tmp_path / "b"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    online_s = time.perf_counter() - t0
    silent.close()
    one_line_error(r, "'org/absent'", "cannot be reached")
    # the wait on the silent hub is wall time, bounded by the same run offline plus the timeouts: a hang would take
    # the 60 s above
    assert online_s < offline_s + 15, (online_s, offline_s)
    print(f"uncached hub id: exit 2 in {offline_s:.2f} s offline, {online_s:.2f} s with a silent hub")


def broken(tmp_path: Path, what: str) -> Path:
    folder = tmp_path / what
    shutil.copytree(TINY_MODEL, folder)
    if what == "no-heads":
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["num_attention_heads"]
        (folder / "config.json").write_text(json.dumps(cfg))
    elif what == "no-weights":
        (folder / "model.safetensors").unlink()
    elif what == "corrupt-weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # a download cut short
    elif what == "no-tokenizer":
        (folder / "tokenizer.json").unlink()
    return folder


BROKEN = {"no-heads": "config.json lacks num_attention_heads", "no-weights": "no weights",
          "corrupt-weights": "model.safetensors is not a readable safetensors file", "no-tokenizer": "no tokenizer"}


@pytest.mark.parametrize("what", BROKEN)
def test_a_broken_model_folder_exits_2_naming_the_problem(tmp_path, what):
    folder = broken(tmp_path, what)
    with pytest.raises(UserError, match=f"model folder {folder}: {BROKEN[what]}"):
        resolve_model(str(folder))
    one_line_error(kvdiag("memleak", "-m", folder, "-d", "auto", "-n", "1", "--max-tokens", "2", "--device", "cpu",
                          "-o", tmp_path / "run"), str(folder), BROKEN[what])
    assert not (tmp_path / "run" / "results.jsonl").exists()  # no worker started


def test_configs_are_read_through_text_config_and_aliases_and_shards_through_the_index(tmp_path):
    folder = broken(tmp_path, "ok")
    cfg = json.loads((folder / "config.json").read_text())
    text = {k: cfg.pop(k) for k in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size")}
    (folder / "config.json").write_text(json.dumps({**cfg, "text_config": text}))
    assert resolve_model(str(folder)) == str(folder)
    gpt2_names = {"n_head": text["num_attention_heads"], "n_embd": text["hidden_size"],
                  "n_layer": text["num_hidden_layers"], "vocab_size": text["vocab_size"]}
    (folder / "config.json").write_text(json.dumps({**cfg, **gpt2_names}))
    assert resolve_model(str(folder)) == str(folder)
    index = {"metadata": {}, "weight_map": {"a.weight": "model.safetensors", "b.weight": "model-2.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="names shard model-2.safetensors, which is missing"):
        resolve_model(str(folder))


def test_the_shipped_model_is_checked_without_loading_weights():
    code = ("import sys, time; from kvdiag.checks.cases import resolve_model; t = time.process_time(); "
            f"p = resolve_model({str(TINY_MODEL)!r}); "
            "print(p, 'torch' in sys.modules, time.process_time() - t < 1.0)")  # CPU seconds
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.split() == [str(TINY_MODEL), "False", "True"], r.stderr
    with pytest.raises(UserError, match="not a folder nor a hub id"):
        resolve_model("no/such/folder")


def test_wanted_files_take_top_level_hf_weights_configs_and_tokenizer():
    from kvdiag.models import label, wanted_files

    files = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer.model", "original/consolidated.00.pth", "README.md", "pytorch_model.bin", ".gitattributes"]
    assert wanted_files(files) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                   "config.json", "model.safetensors.index.json", "tokenizer.json",
                                   "tokenizer.model"]
    assert wanted_files(["config.json", "pytorch_model.bin", "vocab.json", "merges.txt"]) == [
        "pytorch_model.bin", "config.json", "vocab.json", "merges.txt"]
    assert label(f"/c/hub/models--org--name/snapshots/{SHA}") == "name" and label(str(TINY_MODEL)) == "tiny-llama"


def test_config_reads_the_folder_once_for_every_caller_and_falls_back_to_nothing(tmp_path):
    """One reader of config.json for the checks and engines (``models.config``): the whole config or a multimodal
    checkpoint's text part, {} for a folder without a readable one; ``config_dtype`` takes the top level's dtype
    (or the older torch_dtype), else the text part's."""
    from kvdiag.models import config, config_dtype

    assert config(tmp_path) == {} and config_dtype(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert config(tmp_path, text=True) == {}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {"dtype": "bfloat16",
                                                                                               "head_dim": 256}}))
    assert config(tmp_path)["model_type"] == "gemma3" and config(tmp_path, text=True) == {"dtype": "bfloat16",
                                                                                         "head_dim": 256}
    assert config_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16", "num_hidden_layers": 2}))
    assert config(tmp_path, text=True) == config(tmp_path) and config_dtype(tmp_path) == "float16"


def test_the_tokenizer_loads_on_threads_at_once_in_a_fresh_process():
    """`--isolate run` starts its dtypes on threads of one worker, each loading the tokenizer before its engine:
    transformers' first import of AutoTokenizer on two threads at once failed ('cannot import name ...') for the paths
    check, 4 runs of 4. kvdiag loads it one thread at a time (kvdiag.models.hf_tokenizer)."""
    code = ("import threading; from kvdiag.models import hf_tokenizer; from kvdiag.assets import TINY_MODEL\n"
            "out = []\n"
            "load = lambda: out.append(hf_tokenizer(TINY_MODEL).encode('a=1'))\n"
            "ts = [threading.Thread(target=load) for _ in range(4)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "print(len(out), len({tuple(x) for x in out}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.split() == ["4", "1"], r.stderr[-2000:]
