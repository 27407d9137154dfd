"""A checkpoint's plain ``tokenizer.json`` through the ``tokenizers`` library, without importing transformers.

transformers' import takes ~0.9 s of every kvdiag run (the workers' fork server loads it before the first
case) only to wrap the same ``tokenizers.Tokenizer``. :func:`plain` returns this wrapper where it encodes and
decodes exactly as ``PreTrainedTokenizerFast`` does (tests/unit/test_builtin_engine.py compares both), else None.
"""

from __future__ import annotations

import json
from pathlib import Path


class JsonTokenizer:
    """``encode``/``decode``/``eos_token_id``/``bos_token_id`` of a PreTrainedTokenizerFast over the same file."""

    def __init__(self, tokenizer, config: dict):
        self._tok = tokenizer
        self.bos_token_id = self._id(config.get("bos_token"))
        self.eos_token_id = self._id(config.get("eos_token"))

    def _id(self, token) -> int | None:
        content = _content(token)
        return None if content is None else self._tok.token_to_id(content)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def plain(path: Path) -> JsonTokenizer | None:
    """The wrapper for a checkpoint whose tokenizer_config names PreTrainedTokenizerFast over tokenizer.json and
    whose add_bos_token / add_eos_token (which transformers applies itself) agree with the file's template."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
        text = (path / "tokenizer.json").read_text()
        spec = json.loads(text)
    except (OSError, ValueError):
        return None
    if config.get("tokenizer_class") != "PreTrainedTokenizerFast" or not _template_agrees(spec, config):
        return None
    from tokenizers import Tokenizer

    return JsonTokenizer(Tokenizer.from_str(text), config)


def _template_agrees(spec: dict, config: dict) -> bool:
    post = spec.get("post_processor") or {}
    single = post.get("single") if post.get("type") == "TemplateProcessing" else None
    if single is None:
        return "add_bos_token" not in config and "add_eos_token" not in config
    names = [p["SpecialToken"]["id"] for p in single if "SpecialToken" in p]
    first = "SpecialToken" in single[0]
    last = "SpecialToken" in single[-1] and len(single) > 1
    bos, eos = (_content(config.get(k)) for k in ("bos_token", "eos_token"))
    wants_bos, wants_eos = config.get("add_bos_token"), config.get("add_eos_token")
    return ((wants_bos is None or wants_bos == (first and names[0] == bos))
            and (wants_eos is None or wants_eos == (last and names[-1] == eos)))


def _content(token):
    """A special token's text: tokenizer_config writes it as a string or as {"content": ..., ...}."""
    return token.get("content") if isinstance(token, dict) else token
