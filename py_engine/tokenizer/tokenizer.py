"""A pure-Python reader of Hugging Face tokenizer.json files (BPE models).

`Tokenizer.from_file("tokenizer.json")` encodes and decodes with the same ids
as the `tokenizers` library: byte-level BPE (GPT-2, Llama-3, Qwen) and
SentencePiece-style BPE (Llama-2, Phi-3) with their normalizers,
pre-tokenizers, added tokens, post-processors and decoders. Stdlib only, so
it runs in Pyodide. Parts of tokenizer.json it cannot honour raise
ValueError naming the part, rather than produce different ids; loaded from a
file, every such error (and any a malformed file causes) is a ConfigError
naming the file.

Encoding: added tokens are cut out of the text, each remaining piece is
normalized and pre-tokenized into words, and each word goes through the BPE
model (cached per word). `IncrementalDecoder` turns ids back into text as
they are generated.

Refused with ValueError: models other than BPE (Unigram, WordPiece,
WordLevel) and BPE dropout; normalizers Precompiled, BertNormalizer,
StripAccents, Nmt; pre-tokenizers UnicodeScripts and other rare ones;
decoders WordPiece, CTC; regexes using Unicode scripts
(`\\p{Han}`), nested classes or Ruby's `(?m)`; fixed-length padding.
Pair encoding, offsets and `encode_special_tokens` are not offered.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..config import ConfigError
from .added import AddedToken, AddedVocabulary
from .bpe import BPE
from .bytelevel import to_byte_chars
from .config import SpecialTokens, read_pretrained
from .decoders import build_decoder
from .normalizers import build_normalizer
from .pretokenizers import ByteLevel, build_steps
from .processors import build_truncate, build_wrap, check_padding
from .stream import IncrementalDecoder
from .tables import read_tables

__all__ = ["Tokenizer", "IncrementalDecoder"]


@contextmanager
def _errors_name(path: str | Path) -> Iterator[None]:
    """Whatever a malformed tokenizer.json makes the builders raise becomes one ConfigError naming it."""
    try:
        yield
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"{path} not found") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OSError, re.error) as e:
        raise ConfigError(f"{path}: not a tokenizer ruvllm can read ({type(e).__name__}: {e})") from None


class Tokenizer:
    """Encode text to ids and back, as tokenizer.json describes."""

    def __init__(self, spec: dict[str, Any], config: dict[str, Any] | None = None) -> None:
        self.model = _build_model(spec.get("model") or {})
        self._normalizer = build_normalizer(spec.get("normalizer"))
        self._steps = build_steps(spec.get("pre_tokenizer"))
        if self._steps and isinstance(self._steps[-1], ByteLevel):
            # Map bytes per distinct word in the model's cache, not per occurrence.
            self._steps[-1].map_bytes = False
            self.model.word_transform = to_byte_chars
        self._wrap = build_wrap(spec.get("post_processor"))
        self._truncate = build_truncate(spec.get("truncation"))
        check_padding(spec.get("padding"))
        self._decoder = build_decoder(spec.get("decoder"))
        tokens = [AddedToken.from_json(t) for t in spec.get("added_tokens") or []]
        self.added = AddedVocabulary(tokens, self._normalizer)
        self._special_contents = frozenset(t.content for t in tokens if t.special)
        self.config: dict[str, Any] = config or {}
        self.specials = SpecialTokens.from_config(self.config)
        self.chat_template: str | None = self.config.get("chat_template") if isinstance(
            self.config.get("chat_template"), str) else None

    # -- construction -------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a tokenizer.json file; ConfigError naming it when it is not one we can read."""
        with _errors_name(path):
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            if isinstance(spec, dict):
                read_tables(spec.get("model"), Path(path).parent)
            return cls(spec)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json plus tokenizer_config.json from a model folder.

        The config supplies bos/eos/pad/unk tokens, `add_bos_token` /
        `add_eos_token` and the chat template; it stays available raw as
        `.config`. Tokens it leaves out come from config.json's ids."""
        spec, config, chat_template, model_config = read_pretrained(Path(model_dir))
        with _errors_name(Path(model_dir) / "tokenizer.json"):
            tok = cls(spec, config)
            tok.specials = tok.specials.with_model_ids(config, model_config, tok.id_to_token)
        tok.chat_template = chat_template
        return tok

    # -- encoding -----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (BOS/EOS)."""
        ids: list[int] = []
        tokenize = self.model.tokenize
        for piece, token_id, first in self._segments(text):
            if token_id is not None:
                ids.append(token_id)
                continue
            words = [piece]
            for step in self._steps:
                words, first = step(words, first)
            for word in words:
                ids += tokenize(word)
        before, after = self._wrap if add_special_tokens else ([], [])
        if self._truncate is not None:
            ids = self._truncate(ids, len(before) + len(after))
        return before + ids + after if before or after else ids

    def _segments(self, text: str) -> list[tuple[str, int | None, bool]]:
        """(normalized text, None, starts-the-text) or ("", added token id, False)."""
        out: list[tuple[str, int | None, bool]] = []
        normalize = self._normalizer
        for start, stop, token_id in self.added.split_raw(text):
            if token_id is not None:
                out.append(("", token_id, False))
                continue
            piece = text[start:stop]
            if normalize is not None:
                piece = normalize(piece)
            for s, e, inner_id in self.added.split_normalized(piece):
                out.append(("", inner_id, False) if inner_id is not None else (piece[s:e], None, start == 0 == s))
        return out

    # -- decoding -----------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (unknown ids are ignored, as tokenizers does)."""
        tokens = [t for t in (self.token_for_decode(i, skip_special_tokens) for i in ids) if t is not None]
        return self.decode_tokens(tokens)

    def token_for_decode(self, token_id: int, skip_special_tokens: bool) -> str | None:
        """The token string `decode` feeds the decoder for one id, or None to skip it."""
        token = self.id_to_token(token_id)
        if token is None or (skip_special_tokens and token in self._special_contents):
            return None
        return token

    def decode_tokens(self, tokens: list[str]) -> str:
        """Run the decoder over token strings."""
        return "".join(self._decoder(tokens))

    # -- vocabulary ---------------------------------------------------------

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (added tokens first), or None."""
        found = self.added.content_to_id.get(token)
        return found if found is not None else self.model.vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id (added tokens first), or None."""
        found = self.added.id_to_content.get(token_id)
        return found if found is not None else self.model.vocab_r.get(token_id)

    @property
    def vocab_size(self) -> int:
        """Distinct tokens, added ones included (tokenizers' get_vocab_size())."""
        extra = sum(1 for content in self.added.content_to_id if content not in self.model.vocab)
        return len(self.model.vocab) + extra

    def is_special(self, token_id: int) -> bool:
        """True for the id of a special added token (what skip_special_tokens drops)."""
        return self.id_to_token(token_id) in self._special_contents

    @property
    def bos_token(self) -> str | None:
        return self.specials.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.specials.eos_token

    @property
    def pad_token(self) -> str | None:
        return self.specials.pad_token

    @property
    def unk_token(self) -> str | None:
        return self.specials.unk_token or self.model.unk_token

    @property
    def bos_token_id(self) -> int | None:
        return self._id_or_none(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_or_none(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_or_none(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id_or_none(self.unk_token)

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)


def _build_model(spec: dict[str, Any]) -> BPE:
    kind = spec.get("type")
    if kind is None and ("merges" in spec or "ruvllm_tables" in spec):
        kind = "BPE"  # older files leave the type out
    if kind != "BPE":
        raise ValueError(f"model {kind!r} is not supported (only BPE)")
    return BPE(spec)
