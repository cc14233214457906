"""Ring 1: weight quantization in torch (RTN here; AWQ and GPTQ extend it).

Every method produces the same `QuantizedWeight` (unsigned integer codes,
per-block scales and zero points along the input dimension), so the ONNX
packer in `export/` and any future kernel take AWQ or GPTQ output unchanged.
"""
from .rtn import QuantizedWeight, quantize_rtn

__all__ = ["QuantizedWeight", "quantize_rtn"]
