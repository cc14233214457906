"""From a validated request body to what the engine takes: prompt token ids and SamplingParams.

Everything here is a check a client can fail, so every failure is an
`APIError` (400 unless said otherwise) naming the field. The rules where
OpenAI's API leaves a choice:

* Context: a prompt must leave room for one token (`max_model_len` minus the
  prompt), and an explicit `max_tokens` / `max_completion_tokens` larger than
  that room is a 400 naming both numbers, as vLLM and OpenAI do, never a
  silent clamp. Without one, chat generates up to the end of the context;
  completions' default of 16 is clamped to the room.
* Token ids (a prompt given as ids, `logit_bias` keys, `stop_token_ids`) must
  be below the model's vocabulary size; a bad id would otherwise fail inside
  the engine's batch and take other requests down with it.
* `n` (times the prompts of a batch) is at most MAX_CHOICES and top logprobs
  at most MAX_LOGPROBS (vLLM's default), so one request cannot hold the
  whole engine; `top_k` is at most the vocabulary (vLLM's bound too).
* Chat templates: the model's own, or one of its named ones. A template in
  the request (`chat_template_kwargs.chat_template`) is code the server
  would run for a client, so it is refused unless the server was started
  with --allow-client-chat-template; either way it renders bounded
  (templates.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from native_server.api.errors import APIError
from native_server.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from py_engine.chat import ChatConfig
from py_engine.generate import start_ids
from py_engine.guided.tools import messages_for_template
from py_engine.sampling_params import SamplingParams, SamplingParamsError, from_openai

MAX_LOGPROBS = 20
MAX_CHOICES = 128


def _params(body: dict[str, Any], chat: bool) -> SamplingParams:
    try:
        return from_openai(body)
    except SamplingParamsError as exc:
        field, message = exc.field.split("[")[0], str(exc)
        if chat and field == "logprobs":  # chat's count of top logprobs is top_logprobs
            field, message = "top_logprobs", "top_logprobs" + message[len("logprobs"):]
        raise APIError(400, message, field) from None


def _check_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        shown = bad if abs(bad) < 2**64 else f"of {bad.bit_length()} bits"
        raise APIError(400, f"{param}: token id {shown} is out of range; the vocabulary has {vocab_size} tokens",
                       param)


def sampling_params(request: SamplingFields, vocab_size: int) -> SamplingParams:
    """The request's SamplingParams (max_tokens still to be fitted per prompt by `fit_to_context`)."""
    body = request.model_dump(exclude_none=True)
    params = _params(body, isinstance(request, ChatCompletionRequest))
    top = params.logprobs or 0
    if top > MAX_LOGPROBS:
        param = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        raise APIError(400, f"{param}: at most {MAX_LOGPROBS} top logprobs per token, got {top}", param)
    _check_ids(list(params.logit_bias), vocab_size, "logit_bias")
    _check_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    if params.top_k > vocab_size:
        raise APIError(400, f"top_k: at most the vocabulary size ({vocab_size}), got {params.top_k}", "top_k")
    return params


def fit_to_context(params: SamplingParams, prompt_len: int, max_model_len: int, *,
                   explicit_max_tokens: bool, prompt_param: str) -> SamplingParams:
    """Set max_tokens to what the context allows; 400 when the prompt or the asked-for length does not fit."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{prompt_len} tokens, leaving no room to generate. Please shorten the prompt.",
                       prompt_param, "context_length_exceeded")
    if params.max_tokens is None or (params.max_tokens > room and not explicit_max_tokens):
        return dataclasses.replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                            f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                       "max_tokens", "context_length_exceeded")
    return params


def check_choices(n: int, num_prompts: int) -> None:
    if n * num_prompts > MAX_CHOICES:
        raise APIError(400, f"n: at most {MAX_CHOICES} choices per request (n times the prompts), "
                            f"got {n} x {num_prompts}", "n")


# --- chat ---------------------------------------------------------------------------------------------
def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages.{index}.content: only text parts are supported, got type "
                                    f"{part.type!r}", f"messages.{index}.content")
            texts.append(part.text)
        data["content"] = "\n".join(texts)  # vLLM joins text parts with a newline too
    return data


# Parameters of render_chat a request's chat_template_kwargs may not set (they would change what is
# rendered, or how it is bounded, from outside the fields that say so).
_RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "render_limits")


def chat_render_args(request: ChatCompletionRequest, chat_config: ChatConfig,
                     allow_client_template: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and render_chat options of a chat request, with the template policy applied."""
    if not request.messages:
        raise APIError(400, "messages: must be a non-empty list of messages", "messages")
    messages = messages_for_template([_message_dict(m, i) for i, m in enumerate(request.messages)])
    extra = dict(request.chat_template_kwargs or {})
    reserved = next((k for k in _RESERVED_KWARGS if k in extra), None)
    if reserved is not None:
        raise APIError(400, f"chat_template_kwargs.{reserved}: not a template variable; use the request's own "
                            "fields", f"chat_template_kwargs.{reserved}")
    template = extra.get("chat_template")
    named = chat_config.templates if isinstance(chat_config.templates, dict) else {}
    if template is not None and not isinstance(template, str):
        raise APIError(400, "chat_template_kwargs.chat_template: must be a string",
                       "chat_template_kwargs.chat_template")
    if template is not None and template not in named and not allow_client_template:
        raise APIError(400, "chat_template_kwargs.chat_template: this server does not run chat templates sent "
                            "by clients (start it with --allow-client-chat-template to allow it); name one of "
                            f"the model's templates instead: {sorted(named) or 'it has only one'}",
                       "chat_template_kwargs.chat_template")
    return messages, {"add_generation_prompt": request.add_generation_prompt, "tools": request.tools, **extra}


# --- completions --------------------------------------------------------------------------------------
def completion_prompts(request: CompletionRequest, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The prompt(s) as token id lists: a string, ids, or a batch (a list of strings or of id lists)."""
    if request.suffix is not None:
        raise APIError(400, "suffix: not supported", "suffix")
    prompt = request.prompt
    if isinstance(prompt, str):
        batch: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [prompt]  # type: ignore[list-item]
    else:
        batch = list(prompt)  # type: ignore[arg-type]
    if not batch:
        raise APIError(400, "prompt: must not be an empty list", "prompt")
    out = []
    for item in batch:
        if isinstance(item, str):
            out.append(start_ids(tokenizer, item, add_special_tokens=True))
            continue
        if not item:
            raise APIError(400, "prompt: a list of token ids must not be empty", "prompt")
        _check_ids(item, vocab_size, "prompt")
        out.append(list(item))
    return out


def check_best_of(request: CompletionRequest, n: int) -> None:
    if request.best_of is not None and request.best_of != n:
        raise APIError(400, f"best_of: only best_of == n is supported, got best_of={request.best_of}, n={n}",
                       "best_of")
