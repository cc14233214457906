"""Load a Hugging Face checkpoint folder into a `CausalLM`.

The model uses Hugging Face's parameter names, so loading is the identity:
each parameter is looked up by name in the checkpoint, its shape checked,
and the tensor (mapped from disk) converted to the requested dtype and device.
Weights come from `model.safetensors`, sharded safetensors
(`model.safetensors.index.json`), or `pytorch_model.bin` (read with
`torch.load(weights_only=True)`, which refuses arbitrary pickles). Anything
wrong (a truncated or foreign file, a missing tensor, a shape mismatch, a
tensor the config does not explain) raises `ModelLoadError` naming the file
and tensor. A checkpoint whose config.json has a GPTQ or AWQ `quantization_config`
gets `QuantLinear`s built from its packed tensors (py_engine.quant.hf_format).
"""
from __future__ import annotations

import json
import pickle
import zipfile
import warnings
from pathlib import Path, PurePosixPath
from typing import Mapping

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from .errors import ModelLoadError
from .hugepages import huge_page_copy
from .memory import release_library_pages
from .safetensors_io import SafetensorsError, SafetensorsFile
from .skeleton import skeleton
from .transformer import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Buffers older checkpoints saved that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
CONVERT_CHUNK = 1 << 20  # values converted (another dtype or device) between releases of their mapped pages


class Checkpoint:
    """Tensor name -> file, over one or more weight files of a model folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[str, SafetensorsFile | dict[str, Tensor]] = {}
        self.where: dict[str, str] = {}  # tensor name -> file name
        index_names = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
        single_names = ("model.safetensors", "pytorch_model.bin")
        for index, single in zip(index_names, single_names):
            if (folder / index).exists():
                self._add_index(folder / index)
                return
            if (folder / single).exists():
                self._add_file(single)
                return
        raise ModelLoadError(f"no weights in {folder}: expected one of {', '.join(single_names + index_names)}")

    def _add_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError, OSError) as e:
            raise ModelLoadError(f"{index}: not a shard index with a weight_map ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ModelLoadError(f"{index}: weight_map must map tensor names to shard file names")
        for file_name in sorted(set(weight_map.values())):
            _check_shard_name(index, file_name)
            if not (self.folder / file_name).is_file():
                raise ModelLoadError(f"{index} lists shard {file_name}, which is not in {self.folder}")
            self._add_file(file_name)
        for name, file_name in weight_map.items():
            if self.where.get(name) != file_name:
                held = f" ({self.where[name]} does)" if name in self.where else ""
                raise ModelLoadError(f"{index} maps tensor {name!r} to {file_name}, which does not hold it{held}")

    def _add_file(self, file_name: str) -> None:
        path = self.folder / file_name
        tensors = _open_safetensors(path) if file_name.endswith(".safetensors") else _open_bin(path)
        self.files[file_name] = tensors
        for name in tensors.keys():
            self.where[name] = file_name

    def shape(self, name: str) -> tuple[int, ...]:
        f = self.files[self.where[name]]
        return f.shape(name) if isinstance(f, SafetensorsFile) else tuple(f[name].shape)

    def get(self, name: str) -> Tensor:
        f = self.files[self.where[name]]
        return f.get(name) if isinstance(f, SafetensorsFile) else f[name]

    def mapped(self, name: str) -> bool:
        """Whether the tensor is read from a mapped file (a .safetensors), whose pages release() drops."""
        return isinstance(self.files[self.where[name]], SafetensorsFile)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """The tensor's bytes [start, stop) (all by default) were copied: their mapped pages need not stay
        resident."""
        f = self.files[self.where[name]]
        if isinstance(f, SafetensorsFile):
            f.release(name, start, stop)


def _check_shard_name(index: Path, file_name: str) -> None:
    """A shard is a file of the model folder: a plain relative name, never `..`, absolute or a drive.
    (A link inside the folder may point elsewhere, as the Hugging Face cache's do, to its blobs.)"""
    parts = PurePosixPath(file_name.replace("\\", "/")).parts
    if not parts or file_name.startswith(("/", "\\")) or ":" in file_name or any(p in ("..", ".") for p in parts):
        raise ModelLoadError(f"{index}: shard name {file_name!r} leaves the model folder")


def _open_safetensors(path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(path)
    except SafetensorsError as e:
        raise ModelLoadError(str(e)) from None


def _open_bin(path: Path) -> dict[str, Tensor]:
    try:
        with warnings.catch_warnings():  # the refusal below says it all; torch's warnings would only add noise
            warnings.simplefilter("ignore")
            # Only the zip format (torch >= 1.6) can be mapped; older files are read whole.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable PyTorch weights file ({type(e).__name__}: {e})") from None
    if not isinstance(state, Mapping) or not all(isinstance(t, Tensor) for t in state.values()):
        raise ModelLoadError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    return dict(state)


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """"auto" is the checkpoint's torch_dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = config.torch_dtype or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               *, dequantize: bool = False, huge_pages: bool = False) -> tuple[CausalLM, ModelConfig]:
    """Build the model a folder's config.json describes and fill it with its weights.

    dequantize: a GGUF folder's Q4_0/Q4_1/Q8_0 projections load as float weights, not QuantLinear.
    huge_pages: float weights of 2 MiB and more are copied into 2 MiB pages (models/hugepages.py), for a
    CPU decode that streams them as they are; not for weights that are to be quantized next (their float
    copies would all be resident before quantization reads them)."""
    folder = Path(path)
    config = ModelConfig.from_file(folder)
    torch_dtype = resolve_dtype(dtype, config)
    with skeleton():  # shapes only: the weights come from the checkpoint
        model = CausalLM(config)
    release_library_pages()  # what `import torch` ran once (models/memory.py): not resident beside the weights
    checkpoint = _open_checkpoint(folder, model, dequantize)
    consumed = _install_quantized(folder, model, checkpoint, device)
    expected = dict(model.named_parameters())  # tied lm_head.weight is listed once, as the embedding
    _check_names(checkpoint, expected, config, consumed)
    for name, param in expected.items():
        tensor = _checked_tensor(checkpoint, name, tuple(param.shape))
        converted = None
        if huge_pages and torch.device(device).type == "cpu" and isinstance(checkpoint, Checkpoint) \
                and checkpoint.mapped(name):  # copied in chunks, each chunk's file pages dropped
            converted = huge_page_copy(tensor, torch_dtype, lambda first, stop: checkpoint.release(name, first, stop))
        if converted is None:
            converted = _converted(checkpoint, name, tensor, torch_dtype, torch.device(device))
        _set_parameter(model, name, converted)
    if isinstance(model.lm_head, nn.Linear):  # a quantized head is its own tensor
        model.tie_weights()
    if not isinstance(model.model.embed_tokens, nn.Embedding):  # rows gathered from codes (a GGUF's, quant/embedding.py)
        model.model.embed_tokens.dtype = torch_dtype
    if hasattr(checkpoint, "loaded"):  # a GGUF: its mapped pages, all copied by now
        checkpoint.loaded()
    release_library_pages()  # and what loading ran once
    return model.eval().requires_grad_(False), config


def _converted(checkpoint: Checkpoint, name: str, tensor: Tensor, dtype: torch.dtype, device: torch.device,
               chunk: int | None = None) -> Tensor:
    """The tensor in dtype on device: the mapped tensor itself when it is that already, else a copy made
    ~chunk values (whole rows) at a time, each block's mapped pages given back once copied, so that a
    bfloat16 load of a float32 file never holds a whole float32 tensor beside the new weights."""
    if tensor.dtype == dtype and tensor.device == device:
        return tensor
    chunk = chunk or CONVERT_CHUNK
    out = torch.empty(tensor.shape, dtype=dtype, device=device)
    if tensor.dim() < 2 or tensor.numel() <= chunk or not tensor.is_contiguous():
        out.copy_(tensor)
        checkpoint.release(name)
        return out
    rows = max(1, chunk // (tensor.numel() // tensor.shape[0]))
    row_bytes = tensor.numel() // tensor.shape[0] * tensor.element_size()
    for i in range(0, tensor.shape[0], rows):
        out[i:i + rows].copy_(tensor[i:i + rows])  # the same rounding as tensor.to(dtype), element by element
        checkpoint.release(name, i * row_bytes, min(i + rows, tensor.shape[0]) * row_bytes)
    return out


def _open_checkpoint(folder: Path, model: CausalLM, dequantize: bool):
    """The folder's weight files, or the GGUF file a `.gguf` model's folder points at (importers/gguf)."""
    from ..importers.gguf.folder import read_source

    gguf_file = read_source(folder)
    if gguf_file is None:
        return Checkpoint(folder)
    from ..importers.gguf.checkpoint import GGUFCheckpoint
    from ..importers.gguf.reader import open_gguf

    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return GGUFCheckpoint(open_gguf(gguf_file), raw, model, dequantize=dequantize)


def _install_quantized(folder: Path, model: CausalLM, checkpoint: Checkpoint, device) -> set[str]:
    """QuantLinears for a GPTQ/AWQ checkpoint's packed layers (or a GGUF's Q4_0/Q4_1/Q8_0 ones); the names
    of the tensors they took."""
    if hasattr(checkpoint, "install_quantized"):
        return checkpoint.install_quantized(model, device)
    from ..quant.hf_format import QuantFormatError, install_quantized_linears, read_quantization  # quant imports models

    try:
        quant = read_quantization(folder)
        return set() if quant is None else install_quantized_linears(model, quant, checkpoint, device)
    except QuantFormatError as e:
        raise ModelLoadError(str(e)) from None


def _check_names(checkpoint: Checkpoint, expected: Mapping[str, nn.Parameter], config: ModelConfig,
                 consumed: set[str] = frozenset()) -> None:
    missing = [n for n in expected if n not in checkpoint.where]
    if missing:
        files = ", ".join(checkpoint.files)
        raise ModelLoadError(f"{checkpoint.folder}: tensor {missing[0]!r} is missing from {files}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(n for n in checkpoint.where if n not in expected and n not in ignorable
                        and n not in consumed and not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise ModelLoadError(
            f"{checkpoint.folder}: {checkpoint.where[unexpected[0]]} holds tensors a {config.model_type} model "
            f"with this config.json does not have: {', '.join(unexpected[:5])}"
            + (f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))


def _checked_tensor(checkpoint: Checkpoint, name: str, shape: tuple[int, ...]) -> Tensor:
    found = checkpoint.shape(name)
    if found != shape:
        raise ModelLoadError(f"{checkpoint.folder / checkpoint.where[name]}: tensor {name!r} has shape "
                             f"{list(found)} but config.json implies {list(shape)}")
    tensor = checkpoint.get(name)
    if not tensor.is_floating_point():
        raise ModelLoadError(f"{checkpoint.folder / checkpoint.where[name]}: tensor {name!r} has dtype "
                             f"{tensor.dtype}; expected floating point weights")
    return tensor


def _set_parameter(model: nn.Module, name: str, tensor: Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
