"""Linear layers and quantized embeddings as graph nodes, per precision and target.

    y = x @ W^T + b      x [..., K], W [N, K] (nn.Linear layout), y [..., N]

- fp32 / fp16: W^T as a [K, N] initializer and MatMul.
- int8 / int4, native: MatMulNBits over the packed codes (export.packing).
- int8 / int4, web: MatMulNBits over the same codes with float16 scales where
  they are exact and a minimums term for asymmetric blocks (export.web_weights),
  every weight in one external file the page's wasm kernels read too.
A quantized tied embedding reads the LM head's stored rows (Gather and bit ops)
and dequantizes only the rows it needs, so the table is stored once.
A weight that arrives as a `QuantizedWeight` (a QuantLinear of an AWQ / GPTQ /
RTN model, see export.quantized) is packed as it is, whatever the options' precision;
an act-order one (`PermutedWeight`) reads x[..., perm] through a Gather first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from py_engine.quant import QuantizedWeight, quantize_rtn

from .graph import MS_DOMAIN, GraphBuilder
from .options import ExportOptions
from .packing import PackedNBits, pack_matmul_nbits
from .quantized import PermutedWeight, Weight, for_matmul_nbits
from .web_weights import ENGINE_BLOCK, WebInits, matmul, web_initializers, web_weight


@dataclass
class Linear:
    """Emits the projections of one graph with the options' precision and target."""

    g: GraphBuilder
    options: ExportOptions
    float_dtype: type = np.float32  # activations and float weights

    def __call__(self, x: str, weight: Weight, bias: Tensor | None, name: str, quantize: bool = True) -> str:
        if isinstance(weight, PermutedWeight):  # act-order: the codes' columns are x's channels in perm's order
            perm = self.g.initializer(f"{name}.perm", weight.perm.numpy().astype(np.int64))
            x = self.g.node("Gather", [x, perm], f"{name}/ActOrderGather", axis=-1)  # [..., K]
            weight = weight.weight
        record = {}
        if isinstance(weight, QuantizedWeight) or (self.options.quantized and quantize
                                                   and not self.options.prequantized):
            packed = self.packed(weight, name)
            y = self.nbits(x, packed, name)
            record = {"weight": packed}
        else:
            w = self.g.initializer(f"{name}.weight", weight.detach().float().T.numpy().astype(self.float_dtype))
            y = self.g.node("MatMul", [x, w], f"{name}/MatMul")
            record = {"float": w}
        if bias is not None:
            b = self.g.initializer(f"{name}.bias", bias.detach().float().numpy().astype(self.float_dtype))
            y = self.g.node("Add", [y, b], f"{name}/Add")
            record["bias"] = b
        self.g.records[name] = record  # export.web_engine: where the page's kernels find this projection
        return y

    def quantize(self, weight: Tensor) -> QuantizedWeight:
        o = self.options
        return quantize_rtn(weight, o.bits, o.block_size, o.symmetric)

    def packed(self, weight: Tensor | QuantizedWeight, name: str) -> "PackedInits | WebInits":
        g, web = self.g, self.options.target == "web"
        if isinstance(weight, QuantizedWeight):
            q = for_matmul_nbits(weight, name, ENGINE_BLOCK) if web else for_matmul_nbits(weight, name)
        else:
            q = self.quantize(weight)
        if web or (q.bits == 8 and q.offsets is not None):
            # onnxruntime's MatMulNBits takes float zero points at 2 and 4 bits only: 8-bit codes with float
            # minimums (GGUF Q5_1 / Q5_K, or a fused projection beside a Q4_K) take the web form's minimums term
            return web_initializers(g, web_weight(q), name)
        p = pack_matmul_nbits(q)
        zp = None if p.zero_points is None else g.initializer(
            f"{name}.weight_zp", p.zero_points.astype(self.float_dtype) if p.offsets is not None else p.zero_points)
        return PackedInits(p, g.initializer(f"{name}.weight_q{p.bits}", p.B),
                           g.initializer(f"{name}.weight_scales", p.scales.astype(self.float_dtype)), zp)

    def nbits(self, x: str, w: "PackedInits | WebInits", name: str) -> str:
        if isinstance(w, WebInits):
            return matmul(self.g, x, w, name, self.options.accuracy_level)
        p = w.packed
        inputs = [x, w.B, w.scales] + ([w.zero_points] if w.zero_points else [])
        return self.g.node("MatMulNBits", inputs, f"{name}/MatMulNBits", domain=MS_DOMAIN, K=p.K, N=p.N,
                           bits=p.bits, block_size=p.block_size, accuracy_level=self.options.accuracy_level)

    def dequantize_rows(self, codes: str, w: "PackedInits", name: str, n_rows: int | None,
                        index: str | None = None) -> str:
        """Dequantize MatMulNBits rows [R, blocks, blob] (optionally Gather-ed by `index` first) to [..., K_pad]."""
        p, g = w.packed, self.g
        blocks = p.scales.shape[1]
        scales, zero = w.scales, w.zero_points
        if index is not None:  # [..., blocks, blob] for the selected rows only
            codes = g.node("Gather", [codes, index], f"{name}/dq/GatherCodes", axis=0)
            scales = g.node("Gather", [scales, index], f"{name}/dq/GatherScales", axis=0)
            if zero is not None:
                zero = g.node("Gather", [zero, index], f"{name}/dq/GatherZero", axis=0)
        q = self.unpack(codes, p, name)  # [..., blocks, block] float
        z = (g.const(float(1 << (p.bits - 1)), self.float_dtype) if zero is None
             else self.unpack_zero(zero, p, blocks, name))
        w_ = g.node("Mul", [g.node("Sub", [q, z], f"{name}/dq/Sub"),
                            g.node("Unsqueeze", [scales, g.const([-1])], f"{name}/dq/ScalesUnsqueeze")],
                    f"{name}/dq/Mul")  # [..., blocks, block]
        shape = g.const([0, -1] if index is None else [0, 0, -1])
        return g.node("Reshape", [w_, shape], f"{name}/dq/Reshape")

    def unpack(self, codes: str, p: PackedNBits, name: str) -> str:
        """uint8 bytes [..., blob] -> float codes [..., block]."""
        if p.bits == 4:
            codes = self.nibbles(codes, f"{name}/dq")
        return self.g.node("Cast", [codes], f"{name}/dq/Cast", to=onnx_float(self.float_dtype))

    def nibbles(self, packed: str, name: str) -> str:
        """uint8 [..., M] -> uint8 [..., 2M]: low nibble first, as pack_codes stores them."""
        g = self.g
        low = g.node("BitwiseAnd", [packed, g.const(15, np.uint8)], f"{name}/Low")
        high = g.node("BitShift", [packed, g.const(4, np.uint8)], f"{name}/High", direction="RIGHT")
        pairs = g.node("Concat", [g.node("Unsqueeze", [low, g.const([-1])], f"{name}/UnsqLow"),
                                  g.node("Unsqueeze", [high, g.const([-1])], f"{name}/UnsqHigh")],
                       f"{name}/Pairs", axis=-1)  # [..., M, 2]
        lead = g.node("Slice", [g.node("Shape", [packed], f"{name}/Shape"), g.const([0]), g.const([-1])],
                      f"{name}/Lead")
        shape = g.node("Concat", [lead, g.const([-1])], f"{name}/MergedShape", axis=0)
        return g.node("Reshape", [pairs, shape], f"{name}/Merged")  # [..., 2M]

    def unpack_zero(self, zero: str, p: PackedNBits, blocks: int, name: str) -> str:
        """Packed zero points [..., zp_bytes] (or float ones [..., blocks]) -> float [..., blocks, 1]."""
        g = self.g
        if p.offsets is not None:  # already float, one a block
            return g.node("Unsqueeze", [zero, g.const([-1])], f"{name}/dqz/Unsqueeze")
        if p.bits == 4:  # an odd block count leaves a spare nibble at the end of each row
            zero = g.node("Slice", [self.nibbles(zero, f"{name}/dqz"), g.const([0]), g.const([blocks]),
                                    g.const([-1])], f"{name}/dqz/Slice")
        z = g.node("Cast", [zero], f"{name}/dqz/Cast", to=onnx_float(self.float_dtype))
        return g.node("Unsqueeze", [z, g.const([-1])], f"{name}/dqz/Unsqueeze")


@dataclass(frozen=True)
class PackedInits:
    """Initializer names of one packed weight, with the arrays' metadata."""

    packed: PackedNBits
    B: str
    scales: str
    zero_points: str | None


def rows_len(p: PackedNBits) -> int:
    return p.scales.shape[1] * p.block_size


def onnx_float(dtype: type) -> int:
    from onnx import TensorProto
    return TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
