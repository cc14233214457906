"""Ring 1: weight quantization in torch (RTN, AWQ, GPTQ, SmoothQuant) and its kernels.

Every method produces the same `QuantizedWeight` (unsigned integer codes,
per-block scales and zero points along the input dimension), so the ONNX
packer in `export/`, the checkpoint writer and the kernels take any method's
output unchanged. `py_engine.quant.config` is stdlib-only (the CLI imports it
before torch); the torch names below load on first use, so importing that
submodule does not pull torch in.
"""
from __future__ import annotations

from typing import Any

__all__ = ["QuantizedWeight", "quantize_rtn"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import rtn
        return getattr(rtn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
