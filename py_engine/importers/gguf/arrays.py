"""GGUF metadata arrays read without a numpy view per element.

gguf's reader (`GGUFReader._get_field_parts`) makes one numpy view per entry of an array, two per
string: for Qwen2.5's vocabulary (151,936 tokens, their types and 151,387 merges) that is ~900,000
small arrays, ~490 MB of Python objects held as long as the file is open, more than the Q4_0 weights
themselves. `build_fields` reads the same key/value section, but an array of scalars or strings
becomes an `ArrayField`: the values' place in the mapped file (one offset and length per string, in
two int64 arrays), decoded when asked for. Other fields (scalars, strings, nested arrays) are the
reader's own. Only numpy and gguf here, as in reader.py.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np


class ArrayField:
    """A ReaderField's interface (name, types, data for len(), contents()) over a mapped array."""

    def __init__(self, offset: int, name: str, types: list, buffer: np.ndarray, values: Any,
                 lengths: np.ndarray | None = None) -> None:
        self.offset, self.name, self.types = offset, name, types
        self._buffer, self._values, self._lengths = buffer, values, lengths  # values: np array, or string starts
        self.data = range(len(values))  # ReaderField.data holds one index per entry: len() is the count
        self.parts: list = []

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        if self._lengths is None:
            return self._values[index_or_slice].tolist()
        starts, lengths = self._values[index_or_slice], self._lengths[index_or_slice]
        if isinstance(index_or_slice, int):
            return self._string(int(starts), int(lengths))
        return [self._string(int(s), int(n)) for s, n in zip(starts, lengths)]

    def _string(self, start: int, length: int) -> str:
        return str(self._buffer[start:start + length].tobytes(), encoding="utf-8")


def build_fields(reader: Any, offs: int, count: int, max_entries: int) -> int:
    """GGUFReader._build_fields with compact arrays: the key/value section from offs, its end returned;
    an array of more than max_entries is refused before anything is sized by its count."""
    import gguf
    from gguf.gguf_reader import ReaderField

    for _ in range(int(count)):
        start = offs
        key_len, key = reader._get_str(offs)
        offs += int(key_len.nbytes + key.nbytes)
        raw_type = reader._get(offs, np.uint32)
        offs += int(raw_type.nbytes)
        name = str(bytes(key), encoding="utf-8")
        field = None
        if int(raw_type[0]) == gguf.GGUFValueType.ARRAY and reader.byte_order == "I":
            field, end = _array(reader, start, name, offs, max_entries)
        if field is None:  # the reader's own parts
            size, parts, idxs, types = reader._get_field_parts(offs, raw_type[0])
            head = [key_len, key, raw_type]
            field, end = ReaderField(start, name, head + parts, [i + len(head) for i in idxs], types), offs + size
        reader._push_field(field, skip_sum=True)
        offs = end
    return offs


def _array(reader: Any, start: int, name: str, offs: int, max_entries: int) -> tuple[ArrayField | None, int]:
    """The array at offs (after its key and type) as an ArrayField and its end; (None, offs) for a nested one."""
    import gguf

    item = gguf.GGUFValueType(int(reader._get(offs, np.uint32)[0]))
    count = int(reader._get(offs + 4, np.uint64)[0])
    if count > max_entries:  # before anything is sized by it: a hostile count must not allocate
        raise ValueError(f"metadata {name!r}: an array of {count} entries is over the limit of {max_entries}")
    offs += 12
    types = [gguf.GGUFValueType.ARRAY, item]
    buffer = reader.data
    if item == gguf.GGUFValueType.STRING:
        starts, lengths = _strings(buffer, offs, count)
        end = int(starts[-1] + lengths[-1]) if count else offs
        return ArrayField(start, name, types, buffer, starts, lengths), end
    scalar = reader.gguf_scalar_to_np.get(item)
    if scalar is None:
        return None, offs - 12
    values = reader._get(offs, scalar, count)
    if len(values) != count:
        raise ValueError(f"metadata {name!r}: {count} values run past the end of the file")
    return ArrayField(start, name, types, buffer, values), offs + int(values.nbytes)


def _strings(buffer: np.ndarray, offs: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of each of `count` GGUF strings (u64 length, then the bytes) from offs."""
    view = memoryview(buffer)
    size = len(buffer)
    starts, lengths = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
    unpack = struct.Struct("<Q").unpack_from
    for i in range(count):
        if offs + 8 > size:
            raise ValueError(f"a metadata string at byte {offs} runs past the end of the file")
        (n,) = unpack(view, offs)
        offs += 8
        if offs + n > size:
            raise ValueError(f"a metadata string of {n} bytes at byte {offs} runs past the end of the file")
        starts[i], lengths[i] = offs, n
        offs += n
    return starts, lengths
