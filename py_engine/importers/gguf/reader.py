"""Open a GGUF file with ggml's own reader (the `gguf` package) and check what it claims.

`gguf.GGUFReader` maps the file and makes a numpy view per tensor; a bad file
fails inside it with a bare ValueError ("GGUF magic invalid", or a reshape
error for a truncated file). `open_gguf` turns each into one error naming the
file and, where there is one, the tensor:

- not GGUF (wrong magic), an unreadable version or header -> ModelLoadError
- a tensor type the reader does not know                  -> ModelLoadError
- a row length that is not whole blocks of its type        -> ModelLoadError
- tensor data past the end of the file (truncated)         -> ModelLoadError
- a tensor's bytes running into the next tensor's          -> ModelLoadError

Only numpy and gguf here: no torch (resolving a .gguf path writes its config
and tokenizer without loading any weight).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_METADATA_ARRAY = 1 << 22  # entries: a vocabulary of 4M tokens is past any real model


def load_error(message: str) -> ValueError:
    """ModelLoadError (torch's ring) when it can be imported, else a plain ValueError with the message."""
    try:
        from py_engine.models.errors import ModelLoadError  # its package imports torch
    except ImportError:  # no torch: resolving a path still reports the same line
        return ValueError(message)
    return ModelLoadError(message)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its GGUF name, ggml type, shape in torch order ([rows, cols] for a matrix) and raw data."""

    name: str
    type_name: str  # gguf.GGMLQuantizationType name: F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, ...
    shape: tuple[int, ...]  # torch order: ggml's ne reversed
    data: Any  # numpy view of the mapped file: float for F16/F32/BF16-as-uint8..., uint8 rows of blocks otherwise
    n_bytes: int

    @property
    def qtype(self):
        import gguf
        return gguf.GGMLQuantizationType[self.type_name]


class GGUFFile:
    """Metadata and tensors of one GGUF file (mapped, read-only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        reader = _read(self.path)
        self.fields = reader.fields
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                                              t.data, int(t.n_bytes))
        self.size = self.path.stat().st_size

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value: int, float, bool, str, or a list of them; `default` when absent."""
        field = self.fields.get(key)
        if field is None:
            return default
        if len(field.data) > MAX_METADATA_ARRAY:
            raise load_error(f"{self.path}: metadata {key!r} has {len(field.data)} entries, past the limit "
                             f"of {MAX_METADATA_ARRAY}")
        import gguf
        value = field.contents()
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            return list(value)
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            from py_engine.config import ConfigError
            raise ConfigError(f"{self.path}: metadata key {key!r} is missing")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))


def _read(path: Path):
    """gguf.GGUFReader over path, with its failures as one error naming the file (and tensor)."""
    import gguf

    from .arrays import build_fields

    class CheckedReader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:  # arrays without a view per entry (arrays.py)
            return build_fields(self, offs, count, MAX_METADATA_ARRAY)

        def _build_tensors(self, start_offs: int, fields: list) -> None:  # noqa: D401 (the reader's hook)
            _check_tensor_infos(path, self, start_offs, fields)
            super()._build_tensors(start_offs, fields)

    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file {path}")
    try:
        return CheckedReader(path, "c")  # copy-on-write: writable views, the file untouched
    except ValueError as e:
        if getattr(e, "_ruvllm", False):
            raise
        if str(e) == "GGUF magic invalid":
            raise load_error(f"{path}: not a GGUF file (wrong magic bytes)") from None
        raise load_error(f"{path}: not a readable GGUF file ({e}); it may be truncated") from None
    except (IndexError, KeyError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise load_error(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                         "it may be truncated") from None


def _check_tensor_infos(path: Path, reader: Any, start: int, fields: list) -> None:
    """Each tensor's type, block layout and byte range, checked before the reader makes views of them."""
    import gguf

    spans = []
    for field in fields:
        try:
            _, name_data, _, dims, raw_dtype, offset = field.parts
        except ValueError:  # another reader layout: leave the checks to the reader
            return
        name = bytes(name_data).decode("utf-8", "replace")
        try:
            qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
        except ValueError:
            raise _tagged(f"{path}: tensor {name!r} has ggml type {int(raw_dtype[0])}, which this gguf reader "
                          f"does not know") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        ne = [int(d) for d in dims]
        if ne and ne[0] % block:
            raise _tagged(f"{path}: tensor {name!r} of {qtype.name} has rows of {ne[0]} values, not whole "
                          f"blocks of {block}: its size disagrees with its shape")
        n = 1
        for d in ne:
            n *= d
        begin = start + int(offset[0])
        spans.append((begin, begin + n * type_size // block, name, qtype.name, ne))
    size = len(reader.data)
    spans.sort()
    for i, (begin, end, name, kind, ne) in enumerate(spans):
        if end > size:
            raise _tagged(f"{path}: tensor {name!r} ({kind} {list(reversed(ne))}) needs bytes {begin}..{end} but "
                          f"the file has {size}: the file is truncated")
        if i + 1 < len(spans) and end > spans[i + 1][0]:
            raise _tagged(f"{path}: tensor {name!r} ({kind} {list(reversed(ne))}) needs {end - begin} bytes, "
                          f"running into tensor {spans[i + 1][2]!r}: its size disagrees with its shape")


def _tagged(message: str) -> ValueError:
    error = load_error(message)
    error._ruvllm = True  # already names the file and tensor: _read passes it on unchanged
    return error


_OPEN: dict[tuple[str, int, int], GGUFFile] = {}
_KEEP_OPEN = 2  # files kept parsed per process: gguf's reader takes seconds over a large vocabulary


def open_gguf(path: str | Path) -> GGUFFile:
    """GGUFFile(path), parsed once per process while the file is unchanged (resolving a .gguf model
    and loading it then read the metadata once)."""
    file = Path(path).expanduser().resolve()
    stat = file.stat()
    key = (str(file), stat.st_size, stat.st_mtime_ns)
    if key not in _OPEN:
        opened = GGUFFile(file)
        while len(_OPEN) >= _KEEP_OPEN:
            _OPEN.pop(next(iter(_OPEN)))
        _OPEN[key] = opened
    return _OPEN[key]
