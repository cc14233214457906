"""Token logprobs in OpenAI's two shapes, from the engine's `SampleOutput`s.

Chat (`logprobs: true, top_logprobs: k`): `{"content": [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}] * k}]}`.
Legacy completions (`logprobs: k`): `{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}`, where each top dict holds
the top k and the sampled token (so up to k + 1 entries, as OpenAI documents).

A token's text is the tokenizer's decoding of that one id, so a byte-level
token holding part of a UTF-8 character reads as U+FFFD; its `bytes` are then
the raw bytes the token stands for, which clients join to rebuild the text.
The logprobs are the raw model's (see py_engine.sampling), whatever the
sampling settings.
"""
from __future__ import annotations

from typing import Any, Sequence

from native_server.api.protocol import ChatLogprob, ChatLogprobs, ChatLogprobToken, CompletionLogprobs
from py_engine.tokenizer.bytelevel import from_byte_chars
from py_engine.sampling import SampleOutput


class TokenTexts:
    """Text and bytes of single tokens, cached per id (a server asks for the same few thousand)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if "\ufffd" in text:  # part of a character: report the bytes the token stands for
                token = self.tokenizer.id_to_token(token_id)
                raw = from_byte_chars(token) if token is not None else raw
            found = self._cache[token_id] = (text, list(raw))
        return found

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def chat_logprobs(samples: Sequence[SampleOutput], texts: TokenTexts) -> ChatLogprobs:
    content = []
    for sample in samples:
        text, raw = texts.get(sample.token_id)
        top = [ChatLogprob(token=texts.text(t.token_id), logprob=_finite(t.logprob), bytes=texts.get(t.token_id)[1])
               for t in sample.top_logprobs]
        content.append(ChatLogprobToken(token=text, logprob=_logprob(sample), bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(samples: Sequence[SampleOutput], texts: TokenTexts, offset: int) -> CompletionLogprobs:
    """Legacy logprobs; `offset` is where the first token's text starts in the choice's text."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for sample in samples:
        text = texts.text(sample.token_id)
        top = {texts.text(t.token_id): _finite(t.logprob) for t in sample.top_logprobs}
        top.setdefault(text, _logprob(sample))
        tokens.append(text)
        token_logprobs.append(_logprob(sample))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets)


LOGPROB_FLOOR = -9999.0  # OpenAI's and vLLM's stand-in for -inf, which JSON cannot carry


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _logprob(sample: SampleOutput) -> float:
    # None only if the engine skipped logprobs for a request that asked for them (a bug): report the floor.
    return _finite(sample.logprob) if sample.logprob is not None else LOGPROB_FLOOR
