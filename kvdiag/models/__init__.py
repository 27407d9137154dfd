"""``--model``: a local folder or a Hugging Face hub id, resolved once in kvdiag's own process (before any worker
starts) to a checked local folder that the workers load.

A hub id (``gpt2``, ``org/name``) resolves through huggingface_hub to its snapshot folder in the cache
(HF_HUB_CACHE, else HF_HOME/hub): with HF_HUB_OFFLINE set, from the cache only; online, after asking the hub for
its files (a short timeout, HF_HUB_ETAG_TIMEOUT, 10 s by default), falling back to the cache when the hub cannot be
reached. :func:`check_folder` then looks at the folder without loading weights: config.json and the keys an engine
needs, the weights and their safetensors headers, a tokenizer. Anything wrong is one :class:`UserError` line.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

from kvdiag.errors import UserError

# key an engine needs -> the other names configs give it (GPT-2, MPT, T5, ...)
CONFIG_KEYS = {
    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
    "hidden_size": ("n_embd", "d_model"),
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "vocab_size": (),
}
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_HUB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,96}(/[A-Za-z0-9_.-]{1,96})?$")
_TRUE = ("1", "ON", "YES", "TRUE")


def resolve(model: str) -> str:
    """The checked local folder of ``model`` (a folder, a hub id, or ``zoo:NAME``: models.zoo); UserError (exit 2)
    otherwise."""
    from kvdiag.models import zoo

    if zoo.is_zoo(model):
        folder = zoo.resolve(model)
        check_folder(folder, model)
        return str(folder.resolve())
    path = Path(model).expanduser()
    if path.is_dir():
        check_folder(path, model)
        return str(path.resolve())
    if path.exists():
        raise UserError(f"model '{model}' is a file; give a folder with config.json, or a hub id (gpt2, org/name)")
    if not is_hub_id(model):
        raise UserError(f"model not found: '{model}' is not a folder nor a hub id (gpt2, org/name)")
    folder = Path(snapshot(model))
    check_folder(folder, f"{model} ({folder})")
    return str(folder)


def is_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and ".." not in model and "--" not in model and not model.startswith(".")


def label(model: str) -> str:
    """A short name for case ids and reports: the repo name of a hub snapshot, else the folder's name."""
    parts = Path(model.rstrip("/")).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return parts[-1] if parts else model


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub uses, read from the environment now (not when huggingface_hub was imported)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def hub_timeout() -> float:
    try:
        return max(0.5, float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10))
    except ValueError:
        return 10.0


def snapshot(repo_id: str) -> str:
    """The cached snapshot folder of ``repo_id`` (downloading the files an engine needs when online)."""
    cache = hub_cache_dir()
    if hub_offline():
        return _cached(repo_id, cache, "HF_HUB_OFFLINE is set")
    try:
        files = _hub_files(repo_id, hub_timeout())
    except _Unreachable as e:
        return _cached(repo_id, cache, f"the hub cannot be reached: {e}")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=wanted_files(files),
                                 etag_timeout=hub_timeout())
    except Exception as e:  # noqa: BLE001 - a download that fails half-way: one line
        raise UserError(f"model '{repo_id}': download failed: {_one_line(e)}") from None


def _cached(repo_id: str, cache: Path, why: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError and kin across versions)
        raise UserError(f"model '{repo_id}' is not a local folder nor in the Hugging Face cache ({cache}), "
                        f"and {why}") from None


class _Unreachable(Exception):
    pass


def _hub_files(repo_id: str, timeout: float) -> list[str]:
    """The repo's file names; _Unreachable when the hub does not answer within ``timeout`` (a thread with a
    deadline: name resolution is not covered by socket timeouts), UserError when it says no."""
    from huggingface_hub import HfApi

    out: dict = {}

    def ask():
        try:
            out["info"] = HfApi().model_info(repo_id, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - sorted below
            out["error"] = e

    t = threading.Thread(target=ask, daemon=True, name="kvdiag-hub")
    t.start()
    t.join(timeout + 2.0)
    if t.is_alive():
        raise _Unreachable(f"no answer in {timeout:g} s")
    err = out.get("error")
    if err is None:
        return [s.rfilename for s in out["info"].siblings or ()]
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status in (401, 403, 404) or type(err).__name__ in ("RepositoryNotFoundError", "GatedRepoError"):
        raise UserError(f"model '{repo_id}': the hub refuses it ({status or type(err).__name__}): "
                        f"not found, gated or private (log in with 'hf auth login')")
    raise _Unreachable(_one_line(err))


def wanted_files(files: list[str]) -> list[str]:
    """The top-level files an engine loads: safetensors weights (else pytorch_model*.bin), configs, tokenizer."""
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    if len(weights) > 1:  # Mistral repos ship consolidated.safetensors beside the HF shards
        weights = [f for f in weights if not f.startswith("consolidated")] or weights
    if not weights:
        weights = [f for f in top if f.startswith("pytorch_model") and f.endswith(".bin")]
    rest = [f for f in top if f.endswith((".json", ".model", ".txt", ".tiktoken")) or f.startswith("tokenizer")]
    return weights + rest


def check_folder(path: Path, name: str) -> None:
    """What an engine needs, looked at without loading weights; UserError ``model folder NAME: ...`` otherwise."""
    path = Path(path)

    def bad(what: str) -> UserError:
        return UserError(f"model folder {name}: {what}")

    cfg = _read_json(path / "config.json", bad)
    _check_config(cfg, bad)
    _check_weights(path, bad)
    if not any((path / f).is_file() for f in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise bad("no tokenizer (tokenizer.json, tokenizer.model or vocab files)")


def _read_json(file: Path, bad) -> dict:
    if not file.exists():
        raise bad(f"no {file.name}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise bad(f"{file.name} does not parse: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise bad(f"{file.name} is not a JSON object")
    return data


def _check_config(cfg: dict, bad) -> None:
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for key, aliases in CONFIG_KEYS.items():
        value = next((d[k] for d in (text, cfg) for k in (key, *aliases) if d.get(k) is not None), None)
        if value is None:
            raise bad(f"config.json lacks {key}" + (" (in text_config too)" if text else ""))
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad(f"config.json: {key} is {value!r}, not a positive integer")


def _check_weights(path: Path, bad) -> None:
    index = next((path / i for i in INDEXES if (path / i).exists()), None)
    if index is not None:
        weight_map = _read_json(index, bad).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise bad(f"{index.name} has no weight_map")
        files = sorted(set(map(str, weight_map.values())))
        for f in files:
            if not (path / f).is_file():
                raise bad(f"{index.name} names shard {f}, which is missing")
        files = [path / f for f in files]
    else:
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise bad("no weights (*.safetensors or pytorch_model*.bin)")
    for f in files:
        _check_weight_file(f, bad)


def _check_weight_file(file: Path, bad) -> None:
    try:
        with open(file, "rb") as fh:
            head = fh.read(8)
    except OSError as e:
        raise bad(f"cannot read {file.name}: {e.strerror or e}") from None
    if not head:
        raise bad(f"{file.name} is empty")
    if file.suffix != ".safetensors":
        return
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="numpy") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001 - SafetensorError and kin: the header does not parse
        raise bad(f"{file.name} is not a readable safetensors file: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def config(model: str | Path, text: bool = False) -> dict:
    """A model folder's config.json as a dict; {} when it is missing or does not parse (callers fall back to their
    defaults: the folder itself was checked before any worker started, :func:`check_folder`). ``text``: the
    ``text_config`` of a multimodal checkpoint (Gemma 3) when there is one, else the whole config."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    inner = cfg.get("text_config")
    return inner if text and isinstance(inner, dict) else cfg


def sliding_window(cfg: dict) -> int | None:
    """The tokens a sliding-window layer of this (text) config attends to; None when no layer slides: no window, a
    ``layer_types`` without ``sliding_attention``, or Qwen's window left off (``use_sliding_window`` false, its
    default). The one place of this rule (the builtin engine's config and the paths check read it)."""
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if cfg.get("model_type", "").startswith(("qwen2", "qwen3")) and not cfg.get("use_sliding_window", False):
        return None
    types = cfg.get("layer_types")
    if isinstance(types, list) and "sliding_attention" not in types:
        return None
    return window


def config_dtype(model: str | Path) -> str | None:
    """The dtype the checkpoint's config names for its weights (``dtype``, or the older ``torch_dtype``; a
    multimodal checkpoint's top level first, then its ``text_config``); None when it names none."""
    top = config(model)  # read once; its text part is a dict inside it
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else {}
    for cfg in (top, text):
        d = cfg.get("dtype") or cfg.get("torch_dtype")
        if d:
            return str(d)
    return None


def weights_bytes(model: str) -> int:
    """Bytes of a model folder's weight files (safetensors, else PyTorch .bin)."""
    folder = Path(model)
    files = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
    return sum(f.stat().st_size for f in files if f.is_file())


_TOKENIZER_LOCK = threading.Lock()  # transformers' lazy imports are not safe on two threads at once


def hf_tokenizer(model: str | Path):
    """The model folder's Hugging Face tokenizer (transformers' AutoTokenizer), loaded one thread at a time: the
    dtypes of ``--isolate run`` start on threads of one worker, and two first imports of ``AutoTokenizer`` at once
    failed ("cannot import name 'AutoTokenizer' from 'transformers'")."""
    with _TOKENIZER_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model))
