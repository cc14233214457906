"""What is checked and said about a GGUF's quantized blocks as they become kernel weights.

- `check_weight`: every block's float scales (and mins) finite, checked on the copy the kernels will read
  (never on the mapped file: reading every block's scale would map the whole tensor in beside its copy).
  A NaN or infinite scale is a damaged file: one error naming the file, the tensor and the block.
  Truncated tensors and rows that are not whole blocks (a K-quant row of 576 values) are refused by the
  reader (reader.py) before any view of them is made.
- `dequantized_notice`: the tensors of a quantized type the kernels do not run (IQ types, TQ, MXFP4...)
  are dequantized to float at load; one logged line (logger `ruvllm.gguf`, a warning, so it shows
  without any logging set up) names them and the memory they take.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from py_engine.quant.ggml import GGMLWeight
from py_engine.quant.kernels import PackedWeight

from .reader import load_error

log = logging.getLogger("ruvllm.gguf")
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# bytes of each block's fp16 fields (scales d, dmin / m) in the block types kept as the file's blocks
HALF_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}


def check_weight(path: Path, name: str, type_name: str, w: PackedWeight | GGMLWeight) -> None:
    """Raise ModelLoadError naming the file, tensor and block when a block's scale or minimum is not finite."""
    if isinstance(w, GGMLWeight):
        b = w.blocks.view(w.out_features, -1, w.layout.nbytes)  # [N, blocks, bytes]
        fields = [b[..., at:at + 2].contiguous().view(torch.float16).float()[..., 0] for at in HALF_FIELDS[type_name]]
    else:
        fields = [w.scales] + ([w.offsets] if w.offsets is not None else [])
    for values in fields:
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            row, block = (int(i) for i in np.argwhere(bad.cpu().numpy())[0])
            raise load_error(f"{path}: tensor {name!r} ({type_name}) has a scale of {values[row, block].item()} in "
                             f"block {block} of row {row}: the file is damaged")


def dequantized_notice(checkpoint, model: nn.Module, consumed: set[str]) -> str | None:
    """Log (and return) one line naming the quantized tensors left to dequantize, with their float bytes."""
    params = dict(model.named_parameters())
    found: dict[str, list[str]] = {}
    nbytes = 0
    for hf, name in checkpoint.names.items():
        t = checkpoint.gguf.tensors.get(name)
        if hf in consumed or t is None or t.type_name in FLOAT_TYPES or hf not in params:
            continue
        found.setdefault(t.type_name, []).append(name)
        nbytes += params[hf].numel() * params[hf].element_size()
    if not found:
        return None
    count = sum(len(v) for v in found.values())
    kinds = ", ".join(f"{len(v)} {k}" for k, v in sorted(found.items()))
    first = next(iter(found.values()))[0]
    dtype = next(iter(params.values())).dtype
    line = (f"{checkpoint.gguf.path.name}: {count} tensor{'s' * (count > 1)} ({kinds}; e.g. {first}) "
            f"are not run as codes and are dequantized to {str(dtype).replace('torch.', '')}: "
            f"{nbytes / 2**20:,.1f} MiB")
    log.warning(line)
    return line
