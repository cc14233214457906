"""Chat templates: turn a conversation into the prompt text a model was trained on.

Matches transformers 5's `apply_chat_template(tokenize=False)`: the same choice among
a model's named templates, the same special-token variables read from
tokenizer_config.json / special_tokens_map.json / chat_template.jinja, the same
clean-up of messages, and the same sandboxed Jinja environment (chat_sandbox.py).
Imports need the standard library only; jinja2 loads when a template is compiled.

Every render is bounded (`RenderLimits`): the output's length is checked as
it is produced, and an optional deadline between pieces of it; the sandbox
refuses `*` and `**` whose result would be huge. A loop that produces
nothing cannot be stopped from inside one Python process, so a server
renders in a worker process it can kill (native_server/api/templates.py); in
Pyodide these in-process bounds are what there is.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from .chat_sandbox import environment, plain_data

__all__ = ["ChatConfig", "ChatTemplateError", "ChatTemplateSecurityError", "RenderLimits", "load_chat_config",
           "render_chat"]

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
# The special tokens transformers names as attributes; templates see each as a variable.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Older names for a message's reasoning; templates read `reasoning_content` (gpt-oss reads `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or raised while rendering."""


class ChatTemplateSecurityError(ChatTemplateError):
    """A chat template tried something the sandbox forbids (dunder access, mutation)."""


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """Bounds on one render: characters of output, and seconds (checked between output pieces)."""

    max_chars: int = 16 * 1024 * 1024
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class ChatConfig:
    """What rendering needs from a tokenizer: its template(s) and special tokens.

    `templates` is one template, a dict of named ones ("default", "tool_use", ...),
    or None when the model has none; `origin` says where they came from, for errors.
    """

    templates: str | dict[str, str] | None
    special_tokens: dict[str, str]
    origin: str


def load_chat_config(source: str | os.PathLike | Mapping[str, Any] | ChatConfig) -> ChatConfig:
    """Read templates and special tokens from template text, a parsed config or a path.

    A str containing no "{" is a path (no useful template lacks Jinja syntax): a model
    folder, a tokenizer_config.json, or a .jinja template file.
    """
    if isinstance(source, ChatConfig):
        return source
    if isinstance(source, Mapping):
        return _config_from_dict(source, {}, {}, "the tokenizer config passed in")
    if isinstance(source, str) and "{" in source:
        return ChatConfig(source, {}, "the template passed in")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"expected template text, a tokenizer config dict or a path, got {type(source).__name__}")
    return _config_from_path(Path(source))


def _config_from_path(path: Path) -> ChatConfig:
    if not path.exists():
        raise ChatTemplateError(f"no such template file, tokenizer_config.json or model folder: {path}")
    if path.is_file() and path.suffix != ".json":
        return ChatConfig(path.read_text(encoding="utf-8"), {}, f"template file {path}")
    folder = path if path.is_dir() else path.parent
    config_path = path if path.is_file() else folder / CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    tokens_map = _read_json(folder / SPECIAL_TOKENS_MAP_FILE) if (folder / SPECIAL_TOKENS_MAP_FILE).is_file() else {}
    origin = f"{CONFIG_FILE} at {config_path}" if config_path.is_file() else f"model folder {folder}"
    return _config_from_dict(config, tokens_map, _template_files(folder), origin)


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _template_files(folder: Path) -> dict[str, str]:
    """Templates saved as files, which transformers 5 prefers over the config's entry."""
    found = {}
    if (folder / TEMPLATE_FILE).is_file():
        found["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / TEMPLATE_DIR).is_dir():
        for file in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            found[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    return found


def _config_from_dict(
    config: Mapping[str, Any], tokens_map: Mapping[str, Any], files: dict[str, str], origin: str
) -> ChatConfig:
    templates = files or config.get("chat_template")
    if isinstance(templates, list):  # tokenizer_config.json stores named templates as [{name, template}]
        templates = {entry["name"]: entry["template"] for entry in templates}
    if isinstance(templates, dict) and list(templates) == ["default"]:
        templates = templates["default"]
    return ChatConfig(templates, _special_tokens(config, tokens_map), origin)


def _special_tokens(config: Mapping[str, Any], tokens_map: Mapping[str, Any]) -> dict[str, str]:
    """The special-token variables transformers 5 passes to a template, in its order.

    special_tokens_map.json only counts for configs without `added_tokens_decoder`
    (transformers reads it as a legacy file then). Custom `*_token` keys with string
    values, and an `extra_special_tokens` dict, become variables too.
    """
    named = {name: config.get(name) for name in SPECIAL_TOKEN_NAMES}
    if "added_tokens_decoder" not in config:
        named.update({name: tokens_map[name] for name in SPECIAL_TOKEN_NAMES if name in tokens_map})
    custom = {k: v for k, v in config.items() if k.endswith("_token") and k not in named and isinstance(v, str)}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        custom.update(extra)
    tokens = {name: _token_text(value) for name, value in {**named, **custom}.items()}
    return {name: text for name, text in tokens.items() if text is not None}


def _token_text(value: Any) -> str | None:
    """A token is a string or an AddedToken dict ({"content": ..., "lstrip": ...})."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tokenizer_config_or_template: str | os.PathLike | Mapping[str, Any] | ChatConfig,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    *,
    documents: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    render_limits: RenderLimits = RenderLimits(),
    **extra: Any,
) -> str:
    """Render `messages` (OpenAI-shaped dicts) with a model's chat template.

    `chat_template` overrides the model's template: Jinja text, or the name of one of
    its named templates. `extra` become template variables (e.g. `enable_thinking`,
    `date_string`), overriding special tokens of the same name as transformers does.
    A server should pass the ChatConfig from `load_chat_config` so files are read once.
    A render past `render_limits` raises ChatTemplateError.
    """
    config = load_chat_config(tokenizer_config_or_template)
    template = _compile(_select_template(config, chat_template, tools))
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation; pass at least one message")
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise ChatTemplateError("tools must be JSON-schema dicts ({'type': 'function', 'function': {...}})")
    if documents is not None and not all(isinstance(doc, Mapping) for doc in documents):
        raise ChatTemplateError("documents must be dicts with 'title' and 'text' keys")
    variables = plain_data({**config.special_tokens, **extra})
    return _render(
        template,
        render_limits,
        messages=_prepare_messages(messages),
        tools=plain_data(tools),
        documents=plain_data(documents),
        add_generation_prompt=add_generation_prompt,
        **variables,
    )


def _select_template(config: ChatConfig, chat_template: str | None, tools: list | None) -> str:
    """Pick the template text the way transformers' `get_chat_template` does."""
    named = config.templates if isinstance(config.templates, dict) else {}
    if chat_template is not None:
        return named.get(chat_template, chat_template)
    if named:
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(
            f"{config.origin} has several chat templates and none named 'default'; "
            f"pass chat_template=<one of {sorted(named)}> or the template text"
        )
    if config.templates is None:
        raise ChatTemplateError(
            f"{config.origin} has no chat_template (nor a {TEMPLATE_FILE} next to it); pass "
            "chat_template='<jinja text>' to render_chat, or the path of a .jinja template file"
        )
    return config.templates


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Clean messages as transformers does before the template sees them.

    Keys whose value is None are dropped (OpenAI clients send `content=None` next to
    `tool_calls`; templates handle a missing key but print "None"), everything is
    rebuilt from plain types, and older reasoning field names are aliased.
    """
    cleaned = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be dicts, got {message!r}")
        message = plain_data({key: value for key, value in message.items() if value is not None})
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        cleaned.append(message)
    return cleaned


def _render(template: Any, limits: RenderLimits, **variables: Any) -> str:
    """Render piece by piece within `limits`, turning whatever the template raises into a ChatTemplateError."""
    from jinja2.exceptions import SecurityError, TemplateError

    deadline = None if limits.seconds is None else time.monotonic() + limits.seconds
    pieces: list[str] = []
    size = 0
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > limits.max_chars:
                raise ChatTemplateError(f"the chat template's output passed the limit of {limits.max_chars} characters")
            if deadline is not None and time.monotonic() > deadline:
                raise ChatTemplateError(f"the chat template took longer than {limits.seconds:g} s to render")
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateSecurityError(f"chat template blocked by the sandbox: {exc}") from exc
    except TemplateError as exc:  # raise_exception("...") in the template lands here with its message
        raise ChatTemplateError(str(exc)) from exc
    except Exception as exc:  # a template bug (e.g. string + list) must not surface as a server crash
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


@lru_cache(maxsize=64)
def _compile(text: str) -> Any:
    """Compile once per distinct template text; a server renders the same few forever."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return environment().from_string(text)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc
