"""A strict reader of the safetensors format, mapped from disk without copying.

Layout: an 8-byte little-endian header length N, N bytes of JSON mapping each
tensor name to {dtype, shape, data_offsets: [begin, end]} (offsets relative to
the end of the header), then the data. Every claim the header makes is
checked against the file before a tensor is made, so a truncated download or
a foreign file fails with the file and tensor named instead of a crash or
garbage weights.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch
from torch import Tensor

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file."""


class SafetensorsFile:
    """The tensors of one .safetensors file; `get` returns a view of the mapped file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise self._error(f"is {size} bytes long, too short for a safetensors header")
            f.seek(0)
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise self._error(f"declares a {n}-byte header but the file is {size} bytes: "
                                  "truncated, or not a safetensors file")
            header = self._parse_header(f.read(n))
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private pages, writable views
        self._data_start = 8 + n
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries = {name: self._check_entry(name, entry, size - self._data_start)
                         for name, entry in header.items()}

    def _error(self, message: str) -> SafetensorsError:
        return SafetensorsError(f"{self.path}: {message}")

    def _parse_header(self, raw: bytes) -> dict:
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._error(f"header is not JSON ({e}): not a safetensors file") from None
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object: not a safetensors file")
        return header

    def _check_entry(self, name: str, entry: object, data_len: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        if not isinstance(entry, dict) or {"dtype", "shape", "data_offsets"} - entry.keys():
            raise self._error(f"tensor {name!r} has a malformed header entry {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise self._error(f"tensor {name!r} has unsupported dtype {dtype!r}")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise self._error(f"tensor {name!r} has a malformed shape or data_offsets: {entry!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise self._error(f"tensor {name!r} lies at bytes {begin}..{end} of the data but the file holds "
                              f"{data_len} bytes of data: the file is truncated")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != nbytes:
            raise self._error(f"tensor {name!r} of {dtype} {shape} needs {nbytes} bytes but its "
                              f"data_offsets span {end - begin}")
        return DTYPES[dtype], tuple(shape), begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Unmap the pages that hold only this tensor's bytes [start, stop) (all of them by default), once
        they have been copied elsewhere.

        Mapped pages count toward the process's resident memory until the
        file is unmapped: a bfloat16 load of a float32 file would otherwise
        peak at both sizes together. A later get() maps them in again.
        """
        _, _, first, last = self._entries[name]
        begin, end = first + max(0, start), min(last, last if stop is None else first + stop)
        page = mmap.PAGESIZE
        start = -(-(self._data_start + begin) // page) * page  # pages shared with a neighbour stay
        stop = (self._data_start + end) // page * page
        if stop > start and hasattr(self._mmap, "madvise"):
            self._mmap.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def get(self, name: str) -> Tensor:
        """The tensor, backed by the file's pages (copy-on-write)."""
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        offset = self._data_start + begin
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8, count=end - begin, offset=offset)
        if offset % dtype.itemsize:  # misaligned: copy to an aligned buffer first
            raw = raw.clone()
        return raw.view(dtype).view(shape)
