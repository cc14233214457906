"""Quantized stand-ins for `nn.Linear`: the model code calls them exactly as it calls a Linear.

    layer = QuantLinear.from_weight(quantize_rtn(linear.weight, 4, 128, False), linear.bias)
    y = layer(x)  # x [..., K] -> y [..., N], in x's dtype

`QuantLinear` keeps its `QuantizedWeight` (codes, scales, zero points) as the
source of truth: the checkpoint writer and the ONNX exporter read it, and the
forward runs it through the fastest kernel for the device (this reference
version dequantizes and runs a float matmul, the MPS fallback and the oracle
every kernel is tested against).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .rtn import QuantizedWeight


class QuantLinear(nn.Module):
    """y = x @ dequantize(W)^T + b for a weight stored as integer codes in groups."""

    def __init__(self, qweight: QuantizedWeight, bias: Tensor | None = None) -> None:
        super().__init__()
        self.qweight = qweight
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_weight(cls, qweight: QuantizedWeight, bias: Tensor | None = None) -> "QuantLinear":
        return cls(qweight, bias)

    @property
    def bits(self) -> int:
        return self.qweight.bits

    def dequantize(self) -> Tensor:
        """W as float32 [N, K]."""
        return self.qweight.dequantize()

    def forward(self, x: Tensor) -> Tensor:
        w = self.dequantize().to(device=x.device, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w, bias)

    def extra_repr(self) -> str:
        q = self.qweight
        group = f"group={q.block_size}" if q.block_size < q.in_features else "per-channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={q.bits}, {group}, "
                f"{'sym' if q.symmetric else 'asym'}, bias={self.bias is not None}")


@torch.no_grad()
def reference_forward(layer: QuantLinear, x: Tensor) -> Tensor:
    """Dequantize-then-matmul in float32: what every kernel must match."""
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.dequantize().to(x.device), bias)
