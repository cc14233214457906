"""tokenizer_config.json: special tokens, BOS/EOS flags, chat template.

tokenizer.json alone says how to encode; transformers also reads
tokenizer_config.json (and the older special_tokens_map.json) for which
tokens are BOS/EOS/PAD/UNK, and for Llama/Gemma-style classes rebuilds the
post-processor from `add_bos_token` / `add_eos_token`. We do the same.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import ConfigError
from .tables import BPETables, read_tables

# transformers classes whose tokenizer rebuilds TemplateProcessing from
# add_bos_token/add_eos_token (defaults: BOS on, EOS off).
_TEMPLATE_FROM_FLAGS = {
    "LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
    "GemmaTokenizer", "GemmaTokenizerFast",
}


def _content(value: Any) -> str | None:
    """A token given as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class SpecialTokens:
    """The named special tokens of a model, as token strings."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SpecialTokens:
        def flag(name: str) -> bool | None:
            value = config.get(name)
            return bool(value) if value is not None else None

        return cls(_content(config.get("bos_token")), _content(config.get("eos_token")),
                   _content(config.get("pad_token")), _content(config.get("unk_token")),
                   flag("add_bos_token"), flag("add_eos_token"))

    def with_model_ids(self, config: dict[str, Any], model_config: dict[str, Any],
                       id_to_token: Callable[[int], str | None]) -> SpecialTokens:
        """Fill BOS/EOS/PAD the tokenizer `config` leaves out from config.json's ids.

        GPT-2's tokenizer_config.json names no tokens at all; its model
        config says bos_token_id = eos_token_id = 50256. A token the
        tokenizer config sets to null (Qwen's BOS) stays None."""
        found = {}
        for name in ("bos", "eos", "pad"):
            if f"{name}_token" in config:
                continue
            token_id = model_config.get(f"{name}_token_id")
            if isinstance(token_id, list) and token_id:
                token_id = token_id[0]  # several EOS ids: the first is the canonical one
            if isinstance(token_id, int):
                found[f"{name}_token"] = id_to_token(token_id)
        return replace(self, **found) if found else self


def read_pretrained(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any], str | None, dict[str, Any]]:
    """(tokenizer.json, tokenizer config, chat template, model config) of a model folder.

    A file that is not a JSON object, or a special token or chat template of
    the wrong shape, is a ConfigError naming the file."""
    spec = _read_json(model_dir / "tokenizer.json")
    if spec is None:
        raise ConfigError(f"{model_dir / 'tokenizer.json'} not found (ruvllm reads tokenizer.json tokenizers)")
    try:
        read_tables(spec.get("model"), model_dir)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{model_dir / 'tokenizer.json'}: {type(e).__name__}: {e}") from None
    config = _read_json(model_dir / "tokenizer_config.json") or {}
    _check_config(config, model_dir / "tokenizer_config.json")
    special_map = _read_json(model_dir / "special_tokens_map.json") or {}
    _check_config(special_map, model_dir / "special_tokens_map.json")
    for key, value in special_map.items():
        config.setdefault(key, value)  # the older file only fills gaps
    template = config.get("chat_template")
    jinja = model_dir / "chat_template.jinja"
    if not isinstance(template, str) and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if config.get("tokenizer_class") in _TEMPLATE_FROM_FLAGS and (
            "add_bos_token" in config or "add_eos_token" in config):
        spec = dict(spec, post_processor=_flag_template(spec, config))
    model_config = _read_json(model_dir / "config.json") or {}
    return spec, config, template if isinstance(template, str) else None, model_config


def _read_json(path: Path) -> Any:
    """The JSON object in path, None when there is no such file; ConfigError naming it otherwise."""
    if not path.exists():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, RecursionError, OSError) as e:  # JSON, UTF-8, nesting, a folder in its place
        raise ConfigError(f"{path} is not a readable JSON file: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _check_config(config: dict[str, Any], path: Path) -> None:
    """Special tokens are strings or AddedToken objects; a chat template is text or [{name, template}]."""
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, dict) and isinstance(value.get("content"), str)):
            raise ConfigError(f"{path}: {name} must be a string or an AddedToken object, got {value!r:.80}")
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str) and not (
            isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                               and isinstance(t.get("template"), str) for t in template)):
        raise ConfigError(f"{path}: chat_template must be a string or a list of {{name, template}} objects")


def _vocab_id(model: dict[str, Any], token: str) -> int | None:
    """A token's id in the model's vocabulary, whichever form it has (the page's: a token list or binary tables)."""
    vocab = model.get("vocab")
    if isinstance(vocab, list):
        return len(vocab) - 1 - vocab[::-1].index(token) if token in vocab else None  # later duplicates win
    if isinstance(model.get("ruvllm_tables"), bytes):
        return BPETables(model["ruvllm_tables"]).token_id(token)
    return vocab.get(token) if isinstance(vocab, dict) else None


def _flag_template(spec: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """TemplateProcessing for `[BOS] $A [EOS]` as the flags ask."""
    ids = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    single: list[dict[str, Any]] = [{"Sequence": {"id": "A", "type_id": 0}}]
    specials: dict[str, Any] = {}
    for name, default, at_end in (("bos", True, False), ("eos", False, True)):
        wanted = config.get(f"add_{name}_token")
        if not (default if wanted is None else wanted):
            continue
        token = _content(config.get(f"{name}_token"))
        token_id = None if token is None else ids[token] if token in ids else _vocab_id(spec.get("model") or {}, token)
        if token_id is None:
            raise ValueError(f"tokenizer_config: add_{name}_token is set but {name}_token {token!r} has no id")
        item = {"SpecialToken": {"id": token, "type_id": 0}}
        single = single + [item] if at_end else [item] + single
        specials[token] = {"id": token, "ids": [token_id], "tokens": [token]}
    return {"type": "TemplateProcessing", "single": single, "pair": single, "special_tokens": specials}
