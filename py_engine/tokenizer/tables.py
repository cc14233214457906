"""A BPE vocabulary and its merges as int32 arrays over one bytes object (the page's form).

npm/src/bpe_tables.js writes them beside tokenizer.json, whose model names the file in
`"ruvllm_tables"` (and holds no vocab or merges). Why: Pyodide's heap never shrinks, and
49k token strings, 49k merge strings and the dicts over them (~7 MiB for SmolLM2) grew a
restored 30 MiB heap by 20% for good; these tables are ~2 MiB of one bytes object, and no
Python object per token is made even while loading. A lookup probes an array in Python (a
few hundred ns where a dict takes tens); words are cached by the BPE model anyway.

Layout, little-endian int32 unless said:
  header, 8 words: b"RBPE", version 1, n_tokens, n_merges, token_bits, pair_bits, blob_len, 0
  offsets[n_tokens + 1]         token i is blob[offsets[i]:offsets[i + 1]], UTF-8
  token_slots[1 << token_bits]  an id or -1: open addressing from zlib.crc32(UTF-8) & mask, linear probing
  merges[3 * n_merges]          (left id, right id, merged id) in rank order
  pair_slots[1 << pair_bits]    a rank or -1: from ((left * P1 ^ right * P2) mod 2**32) >> (32 - pair_bits)
  blob[blob_len]
"""
from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from zlib import crc32

MAGIC = b"RBPE"
VERSION = 1
HEADER_WORDS = 8
P1, P2 = 0x9E3779B1, 0x85EBCA77
MAX_BYTES = 1 << 30  # a 256k vocabulary with 1M merges is ~30 MiB
NO_RANK = 1 << 62


class BPETables:
    """The arrays of one tables file, checked so that no lookup can run past them or loop forever."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 4 * HEADER_WORDS or data[:4] != MAGIC:
            raise ValueError("BPE tables: not a ruvllm tables file (no RBPE header)")
        version, n, m, token_bits, pair_bits, blob_len, _ = _ints(data, 4, HEADER_WORDS - 1)
        if version != VERSION:
            raise ValueError(f"BPE tables: version {version}, this reader knows {VERSION}")
        if not (4 <= token_bits <= 28 and 4 <= pair_bits <= 28 and 0 <= n < 1 << token_bits
                and 0 <= m < 1 << pair_bits and blob_len >= 0):
            raise ValueError("BPE tables: header sizes out of range")
        sizes = (n + 1, 1 << token_bits, 3 * m, 1 << pair_bits)
        if 4 * (HEADER_WORDS + sum(sizes)) + blob_len != len(data):
            raise ValueError(f"BPE tables: {len(data)} bytes, the header says otherwise")
        at = 4 * HEADER_WORDS
        parts = []
        for size in sizes:
            parts.append(_ints(data, at, size))
            at += 4 * size
        self.offsets, self.token_slots, self.merges, self.pair_slots = parts
        self.data, self.blob, self.size, self.n_merges = data, at, n, m
        self._token_mask, self._pair_shift = (1 << token_bits) - 1, 32 - pair_bits
        self._pair_mask = (1 << pair_bits) - 1
        _check(self.offsets, 0, blob_len, "offsets")
        if self.offsets[0] != 0 or self.offsets[n] != blob_len:
            raise ValueError("BPE tables: offsets do not span the blob")
        _check(self.merges, 0, n - 1, "merges")
        for slots, top, what in ((self.token_slots, n - 1, "token slots"), (self.pair_slots, m - 1, "pair slots")):
            _check(slots, -1, top, what)
            if -1 not in slots:  # a probe stops at an empty slot
                raise ValueError(f"BPE tables: {what} have no empty slot")

    def token(self, token_id: int) -> str:
        """The token of an id in 0 .. size - 1."""
        offsets, at = self.offsets, self.blob
        return self.data[at + offsets[token_id]:at + offsets[token_id + 1]].decode("utf-8")

    def token_id(self, token: str) -> int | None:
        """Id of a vocabulary token, or None."""
        try:
            raw = token.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no vocabulary token (the JS side refuses those)
            return None
        slots, offsets, data, at, mask = self.token_slots, self.offsets, self.data, self.blob, self._token_mask
        slot = crc32(raw) & mask
        while True:
            i = slots[slot]
            if i < 0:
                return None
            if data[at + offsets[i]:at + offsets[i + 1]] == raw:
                return i
            slot = (slot + 1) & mask

    def rank(self, left: int, right: int) -> int:
        """Rank of the merge of two ids, NO_RANK when there is none."""
        slots, merges, mask = self.pair_slots, self.merges, self._pair_mask
        slot = ((left * P1 ^ right * P2) & 0xFFFFFFFF) >> self._pair_shift
        while True:
            r = slots[slot]
            if r < 0:
                return NO_RANK
            if merges[3 * r] == left and merges[3 * r + 1] == right:
                return r
            slot = (slot + 1) & mask


def _ints(data: bytes, at: int, count: int) -> Any:
    """`count` int32 from byte `at`: a view, not a copy, where the machine is little-endian (wasm, x86, arm)."""
    if sys.byteorder == "little" and array("i").itemsize == 4:
        return memoryview(data)[at:at + 4 * count].cast("i")
    out = array("i" if array("i").itemsize == 4 else "l")
    for j in range(count):
        out.append(int.from_bytes(data[at + 4 * j:at + 4 * j + 4], "little", signed=True))
    return out


def _check(values: Any, low: int, high: int, what: str) -> None:
    if len(values) and (min(values) < low or max(values) > high):
        raise ValueError(f"BPE tables: {what} hold values outside {low} .. {high}")


def read_tables(model: dict[str, Any], folder: Path) -> None:
    """Replace a BPE model's `"ruvllm_tables"` file name (beside tokenizer.json) by the file's bytes."""
    name = model.get("ruvllm_tables") if isinstance(model, dict) else None
    if not isinstance(name, str):
        if name is not None and not isinstance(name, (bytes, BPETables)):
            raise ValueError("model BPE: ruvllm_tables must name a file beside tokenizer.json")
        return
    if not name or name != os.path.basename(name) or name.startswith(".") or "\\" in name:
        raise ValueError(f"model BPE: ruvllm_tables {name!r} must be a file name beside tokenizer.json")
    path = folder / name
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"model BPE: {path} is {size} bytes, more than {MAX_BYTES}")
    model["ruvllm_tables"] = path.read_bytes()


class TokenIds(Mapping):
    """token -> id over the tables, read as a dict."""

    __slots__ = ("_tables",)

    def __init__(self, tables: BPETables) -> None:
        self._tables = tables

    def __getitem__(self, token: str) -> int:
        found = self._tables.token_id(token) if type(token) is str else None
        if found is None:
            raise KeyError(token)
        return found

    def get(self, token: Any, default: Any = None) -> Any:
        found = self._tables.token_id(token) if type(token) is str else None
        return default if found is None else found

    def __contains__(self, token: object) -> bool:
        return type(token) is str and self._tables.token_id(token) is not None

    def __iter__(self) -> Iterator[str]:
        return map(self._tables.token, range(self._tables.size))

    def __len__(self) -> int:
        return self._tables.size


class TokenList(Mapping):
    """id -> token over the tables, read as a dict (each lookup decodes the token's bytes)."""

    __slots__ = ("_tables",)

    def __init__(self, tables: BPETables) -> None:
        self._tables = tables

    def __getitem__(self, token_id: int) -> str:
        if type(token_id) is int and 0 <= token_id < self._tables.size:
            return self._tables.token(token_id)
        raise KeyError(token_id)

    def get(self, token_id: Any, default: Any = None) -> Any:
        if type(token_id) is int and 0 <= token_id < self._tables.size:
            return self._tables.token(token_id)
        return default

    def __contains__(self, token_id: object) -> bool:
        return type(token_id) is int and 0 <= token_id < self._tables.size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._tables.size))

    def __len__(self) -> int:
        return self._tables.size
