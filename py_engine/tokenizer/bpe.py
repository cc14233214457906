"""The BPE model of tokenizer.json: words to ids by ranked merges.

Matches `tokenizers`' BPE: a word starts as one symbol per character (with
`continuing_subword_prefix` / `end_of_word_suffix`, `<0xXX>` byte fallback
or the unknown token, fused or not), then the lowest-ranked adjacent pair is
merged, leftmost first, until no pair has a rank. `ignore_merges` (Llama-3)
takes a word that is itself in the vocabulary as one token.

Loading is cheap on purpose: the merge table is a dict from the merge's own
"a b" string to its rank, built without splitting 280k strings; a lookup
joins the pair instead. A model whose `"ruvllm_tables"` holds the page's
binary tables (tables.py) merges ids instead, over arrays, with no Python
object per token or merge.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .tables import NO_RANK as _NO_RANK
from .tables import BPETables, TokenIds, TokenList

_CACHE_LIMIT = 200_000
_CHAR_LIMIT = 4096  # distinct characters whose ids the tables form keeps in a dict


class BPE:
    """A tokenizer.json `"model"` of type BPE."""

    def __init__(self, spec: dict[str, Any]) -> None:
        if spec.get("dropout") not in (None, 0, 0.0):
            raise ValueError("model BPE: dropout makes encoding random; it is not supported")
        tables = spec.get("ruvllm_tables")
        self._tables: BPETables | None = None
        if tables is not None:
            if not isinstance(tables, (bytes, BPETables)):
                raise ValueError("model BPE: ruvllm_tables names a file that was not read (load the tokenizer "
                                 "with Tokenizer.from_file or from_pretrained)")
            self._tables = tables if isinstance(tables, BPETables) else BPETables(tables)
            self.vocab, self.vocab_r, ints = TokenIds(self._tables), TokenList(self._tables), None
        else:
            self.vocab, self.vocab_r, ints = _vocabulary(spec["vocab"])
        self.unk_token: str | None = spec.get("unk_token")
        self.prefix: str = spec.get("continuing_subword_prefix") or ""
        self.suffix: str = spec.get("end_of_word_suffix") or ""
        self.fuse_unk = bool(spec.get("fuse_unk", False))
        self.byte_fallback = bool(spec.get("byte_fallback", False))
        self.ignore_merges = bool(spec.get("ignore_merges", False))
        self._sep, self._ranks = _rank_table(spec.get("merges") or [] if tables is None else [], ints)
        self._cache: dict[str, list[int]] = {}
        self._char_ids: dict[str, int] = {}  # the tables form's ids of single characters met so far
        # Set by the tokenizer when a final ByteLevel pre-tokenizer's mapping
        # is deferred to here, so the cache is keyed by the raw word.
        self.word_transform: Callable[[str], str] | None = None

    def tokenize(self, word: str) -> list[int]:
        """Ids of one pre-tokenized word (cached; do not mutate the result)."""
        ids = self._cache.get(word)
        if ids is None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            text = self.word_transform(word) if self.word_transform else word
            ids = self._cache[word] = self._tokenize(text) if text else []
        return ids

    def _tokenize(self, word: str) -> list[int]:
        if self._tables is not None:
            return self._tokenize_ids(word, self._tables)
        vocab = self.vocab
        if self.ignore_merges and word in vocab:
            return [vocab[word]]
        symbols = self._merge(self._symbols(word))
        return [vocab[s] for s in symbols]

    def _tokenize_ids(self, word: str, tables: BPETables) -> list[int]:
        """`_tokenize` over the binary tables: the same symbols, merged as ids (tokenizers' own way)."""
        if self.ignore_merges:
            found = tables.token_id(word)
            if found is not None:
                return [found]
        ids: list[int] | None = None
        if not (self.prefix or self.suffix):
            chars, ids = self._char_ids, []
            for c in word:
                i = chars.get(c)
                if i is None:
                    i = tables.token_id(c)
                    if i is None:
                        ids = None  # unknown or byte fallback: the general path
                        break
                    if len(chars) >= _CHAR_LIMIT:
                        chars.clear()
                    chars[c] = i
                ids.append(i)
        if ids is None:
            vocab = self.vocab
            ids = [vocab[s] for s in self._symbols(word)]
        return self._merge_ids(ids, tables)

    def _symbols(self, word: str) -> list[str]:
        """One vocabulary token per character before any merge."""
        vocab, prefix, suffix = self.vocab, self.prefix, self.suffix
        if not (prefix or suffix) and all(c in vocab for c in word):
            return list(word)
        out: list[str] = []
        unk: str | None = None  # pending unknown token (fused while fuse_unk)
        last = len(word) - 1
        for i, c in enumerate(word):
            s = (prefix + c if i and prefix else c) + (suffix if i == last else "")
            if s in vocab:
                if unk is not None:
                    out.append(unk)
                    unk = None
                out.append(s)
                continue
            if self.byte_fallback:
                codes = [f"<0x{b:02X}>" for b in s.encode("utf-8")]
                if all(code in vocab for code in codes):
                    out.extend(codes)  # like tokenizers, a pending unk waits until later
                    continue
            if self.unk_token is not None:
                if self.unk_token not in vocab:
                    raise ValueError(f"model BPE: unk_token {self.unk_token!r} is not in the vocabulary")
                if unk is not None and not self.fuse_unk:
                    out.append(unk)
                unk = self.unk_token
        if unk is not None:
            out.append(unk)
        return out

    def _merge(self, parts: list[str]) -> list[str]:
        """Apply merges, lowest rank first and leftmost among equals.

        One merge per step, as tokenizers' heap does; `min` and `index` over
        the list of pair ranks run in C, and only the two neighbouring pairs
        are looked up again after a merge."""
        if len(parts) < 2:
            return parts
        get, sep, cut = self._ranks.get, self._sep, len(self.prefix)
        ranks = [get(a + sep + b, _NO_RANK) for a, b in zip(parts, parts[1:])]
        while ranks:
            best = min(ranks)
            if best == _NO_RANK:
                break
            i = ranks.index(best)
            right = parts.pop(i + 1)
            merged = parts[i] = parts[i] + (right[cut:] if cut and right.startswith(self.prefix) else right)
            del ranks[i]
            if i < len(ranks):
                ranks[i] = get(merged + sep + parts[i + 1], _NO_RANK)
            if i:
                ranks[i - 1] = get(parts[i - 1] + sep + merged, _NO_RANK)
        return parts


    @staticmethod
    def _merge_ids(ids: list[int], tables: BPETables) -> list[int]:
        """`_merge` over ids: a pair's rank from the tables, the merged id from its merge."""
        if len(ids) < 2:
            return ids
        rank, merges = tables.rank, tables.merges
        ranks = [rank(a, b) for a, b in zip(ids, ids[1:])]
        while ranks:
            best = min(ranks)
            if best == _NO_RANK:
                break
            i = ranks.index(best)
            del ids[i + 1]
            merged = ids[i] = merges[3 * best + 2]
            del ranks[i]
            if i < len(ranks):
                ranks[i] = rank(merged, ids[i + 1])
            if i:
                ranks[i - 1] = rank(ids[i - 1], merged)
        return ids


def _vocabulary(vocab: dict[str, int] | list[str]) -> tuple[dict[str, int], Mapping[int, str], list[int] | None]:
    """(token -> id, id -> token, the ids 0 .. n - 1 as the vocabulary's own int objects, or None).

    `vocab` is tokenizer.json's object, or a list of the tokens in id order: the form the page hands its
    Python (npm/src/model.js compactTokenizer), which parses without json's key memo and its dict resizes,
    both of which stay in a Pyodide heap (it never shrinks) as the high-water mark of a load."""
    if isinstance(vocab, list):
        if not all(type(t) is str for t in vocab):
            raise ValueError("model BPE: a vocab list must hold the tokens (strings) in id order")
        ids = list(range(len(vocab)))
        return dict(zip(vocab, ids)), IdTable(vocab), ids
    table = id_table(vocab)
    return vocab, table, sorted(vocab.values()) if isinstance(table, IdTable) else None


def _rank_table(merges: list[Any], ints: list[int] | None = None) -> tuple[str, dict[str, int]]:
    """(separator, {"a<sep>b": rank}) for either merges layout.

    Later duplicates win, as in tokenizers' HashMap. The "a b" layout can
    be used as is; the [a, b] layout is joined with a separator that no
    merged token contains, so keys cannot collide. The ranks are `ints`'
    objects where there are enough (ids above 256 are objects of 32 bytes)."""
    if not merges:
        return " ", {}
    ranks = ints if ints is not None and len(ints) >= len(merges) else range(len(merges))  # zip: the merges' end
    if isinstance(merges[0], str):
        return " ", dict(zip(merges, ranks))
    # Joined with map/str.join and counted in one string: C loops, ~3x faster than a comprehension, which
    # matters in Pyodide where the table is built on every page load (49k merges for SmolLM2).
    if set(map(len, merges)) != {2}:
        raise ValueError("model BPE: every merge must be a pair of tokens")
    keys = list(map(" ".join, merges))
    if "".join(keys).count(" ") == len(keys):  # no token holds a space: " " separates
        return " ", dict(zip(keys, ranks))
    used = {c for pair in merges for part in pair for c in part}
    sep = next(chr(c) for c in range(0x10FFFF, 0, -1) if chr(c) not in used)
    return sep, {a + sep + b: rank for rank, (a, b) in zip(ranks, merges)}


class IdTable(Mapping):
    """id -> token of a vocabulary whose ids are 0 .. n - 1: a list (8 bytes an id, where a dict takes ~32 and
    49k entries of SmolLM2 were 1.5 MiB more of a Pyodide heap, which never shrinks), read as a dict."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[str]) -> None:
        self._tokens = tokens

    def __getitem__(self, token_id: int) -> str:
        if type(token_id) is int and 0 <= token_id < len(self._tokens):
            return self._tokens[token_id]
        raise KeyError(token_id)

    def get(self, token_id: Any, default: Any = None) -> Any:
        if type(token_id) is int and 0 <= token_id < len(self._tokens):
            return self._tokens[token_id]
        return default

    def __contains__(self, token_id: object) -> bool:
        return type(token_id) is int and 0 <= token_id < len(self._tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._tokens)))

    def __len__(self) -> int:
        return len(self._tokens)


def id_table(vocab: dict[str, int]) -> Mapping[int, str]:
    """id -> token: an IdTable when the ids are exactly 0 .. n - 1, else a dict (later duplicates win)."""
    tokens: list[Any] = [None] * len(vocab)
    for token, i in vocab.items():
        if type(i) is not int or not 0 <= i < len(tokens) or tokens[i] is not None:
            return dict(zip(vocab.values(), vocab.keys()))  # C loops: load time
        tokens[i] = token
    return IdTable(tokens)
