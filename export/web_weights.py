"""The web target's quantized weights: codes that stay codes, in one file that every runtime reads.

Per weight W [N, K] quantized in blocks along K (block b = k // block):

    codes   uint8 [N, blocks, block * bits / 8]   MatMulNBits' bytes (export.packing: 4 bits, k = 2j in the
                                                  low nibble of byte j, k = 2j + 1 in the high one)
    scales  d [N, blocks]   float16 when every scale is a half exactly (a GGUF's are), else float32
    mins    m [N, blocks]   optional, the same dtype rule

    w[n, k] = q d + m             m: GGUF Q4_1's minimum, or -z d for per-block integer zero points
    w[n, k] = (q - 2**(bits-1)) d  without m (symmetric)

In the graph: MatMulNBits(x, codes, Cast(d)) + blocksum(x) @ (Cast(m) + 2**(bits-1) Cast(d))^T, so onnxruntime
(CPython, Node, the browser's WebGPU and wasm backends) multiplies the codes as codes; the Casts of the small
scale tensors are folded when the session starts, the weights never are. The page's own wasm kernels
(web/kernels) read the same bytes from the same file (export.web_engine writes where each tensor is), with
int8 activations per block as MatMulNBits' accuracy_level 4 does. A tied embedding gathers rows of the LM
head's codes (standard ops: Gather, nibble shifts, Cast), so the table is stored once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from py_engine.quant import QuantizedWeight

from .graph import MS_DOMAIN, GraphBuilder
from .packing import pack_codes

ENGINE_BLOCK = 32  # the block the page's wasm kernels take (GGUF's; RTN's default)


@dataclass(frozen=True)
class WebWeight:
    """One weight in the web form, before it is written."""

    codes: np.ndarray  # [N, blocks, block * bits / 8] uint8
    d: np.ndarray  # [N, blocks] float32
    m: np.ndarray | None  # [N, blocks] float32
    bits: int
    block_size: int
    N: int
    K: int

    @property
    def blocks(self) -> int:
        return self.d.shape[1]

    @property
    def k_pad(self) -> int:
        return self.blocks * self.block_size


def web_weight(q: QuantizedWeight) -> WebWeight:
    """The codes, scales and (when not symmetric) minimums of q; refuses what has no such form."""
    n, blocks, block = q.out_features, q.blocks, q.block_size
    codes = q.codes.numpy().copy()
    codes[:, q.in_features:] = 0  # padding past K is never read
    packed = pack_codes(codes.reshape(n, blocks, block), q.bits)  # [N, blocks, block * bits / 8]
    d = q.scales.numpy().astype(np.float32)
    z = q.zero_points.numpy().astype(np.float32)
    default = float(1 << (q.bits - 1))
    if q.offsets is None and bool((z == default).all()):
        return WebWeight(packed, d, None, q.bits, block, n, q.in_features)
    m = -z * d  # (q - z) d + offset = q d + (offset - z d)
    if q.offsets is not None:
        m = m + q.offsets.numpy().astype(np.float32)
    return WebWeight(packed, d, m.astype(np.float32), q.bits, block, n, q.in_features)


def stored(a: np.ndarray) -> np.ndarray:
    """float16 when every value is a half exactly (no rounding), else float32."""
    half = a.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), a, equal_nan=True) else a.astype(np.float32)


@dataclass(frozen=True)
class WebInits:
    """Initializer names of one web weight in the graph, and the float32 names its ops read."""

    weight: WebWeight
    codes: str
    scales: str  # the stored initializer (float16 or float32)
    mins: str | None
    scales_f32: str  # Cast(scales) or scales itself
    mins_f32: str | None


def web_initializers(g: GraphBuilder, w: WebWeight, name: str) -> WebInits:
    codes = g.initializer(f"{name}.weight_q{w.bits}", w.codes)
    scales = g.initializer(f"{name}.weight_scales", stored(w.d))
    mins = None if w.m is None else g.initializer(f"{name}.weight_mins", stored(w.m))
    return WebInits(w, codes, scales, mins, _as_float(g, scales, w.d, f"{name}/scales"),
                    None if mins is None else _as_float(g, mins, w.m, f"{name}/mins"))


def _as_float(g: GraphBuilder, init: str, values: np.ndarray, name: str) -> str:
    if stored(values).dtype == np.float32:
        return init
    return g.node("Cast", [init], f"{name}/float", to=TensorProto.FLOAT)  # folded at session start


def matmul(g: GraphBuilder, x: str, w: WebInits, name: str, accuracy_level: int) -> str:
    """x [..., K] @ W^T -> [..., N] on the codes: MatMulNBits (its default zero point), plus the minimums' term."""
    p = w.weight
    y = g.node("MatMulNBits", [x, w.codes, w.scales_f32], f"{name}/MatMulNBits", domain=MS_DOMAIN, K=p.K, N=p.N,
               bits=p.bits, block_size=p.block_size, accuracy_level=accuracy_level)
    if p.m is None:
        return y
    return g.node("Add", [y, _mins_term(g, x, w, name)], f"{name}/AddMins")


def centred_mins(g: GraphBuilder, w: WebInits, name: str) -> str:
    """m + zp d [N, blocks] float32, so that (q - zp) d + (m + zp d) = q d + m with MatMulNBits' default zero
    point: no zero-point input (onnxruntime 1.31 miscomputes one that is not an initializer) and centred codes,
    whose products with int8 activations carry less of the activations' rounding. Folded at session start;
    the page's kernels compute the same float32 sum (web/kernels/engine.c)."""
    done = g.records.setdefault("_centred_mins", {})  # a tied table's head and embedding share one
    if w.mins not in done:
        zp = g.const(float(1 << (w.weight.bits - 1)), np.float32)
        done[w.mins] = g.node("Add", [w.mins_f32, g.node("Mul", [w.scales_f32, zp], f"{name}/zp_d")],
                              f"{name}/centred")
    return done[w.mins]


def _mins_term(g: GraphBuilder, x: str, w: WebInits, name: str) -> str:
    """sum_b m'[n, b] sum_{k in b} x[..., k] -> [..., N]: block sums of x times the centred minimums."""
    p = w.weight
    if p.k_pad != p.K:  # [..., K] -> [..., K_pad]: the padded columns hold no weight
        x = g.node("Pad", [x, g.const([0, p.k_pad - p.K]), g.const(0.0, np.float32), g.const([-1])],
                   f"{name}/mins/pad")
    blocks = g.node("Reshape", [x, g.const([0, 0, p.blocks, p.block_size])], f"{name}/mins/blocks")
    sums = g.node("ReduceSum", [blocks, g.const([-1])], f"{name}/mins/sums", keepdims=0)  # [B, T, blocks]
    return gemm(g, sums, centred_mins(g, w, f"{name}/mins"), p.N, p.blocks, f"{name}/mins")


def gemm(g: GraphBuilder, x: str, w: str, n: int, k: int, name: str) -> str:
    """x [B, T, K] @ W^T for W [N, K] read in place (Gemm transB) -> [B, T, N]."""
    flat = g.node("Reshape", [x, g.const([-1, k])], f"{name}/flat")  # [rows, K]
    y = g.node("Gemm", [flat, w], f"{name}/Gemm", transB=1)  # [rows, N]
    lead = g.node("Slice", [g.node("Shape", [x], f"{name}/shape"), g.const([0]), g.const([-1])], f"{name}/lead")
    shape = g.node("Concat", [lead, g.const([n])], f"{name}/out_shape", axis=0)
    return g.node("Reshape", [y, shape], f"{name}/unflat")


def gather_rows(g: GraphBuilder, w: WebInits, index: str, name: str) -> str:
    """Rows [B, T, K_pad] of the stored table for token ids `index` [B, T], dequantized (the tied embedding):
    (q - zp) d (+ the centred minimums), as the page's kernels dequantize them."""
    p = w.weight
    codes = g.node("Gather", [w.codes, index], f"{name}/rows", axis=0)  # [B, T, blocks, blob]
    if p.bits == 4:  # low nibble first: [.., blob] -> [.., blob, 2] -> [.., block]
        low = g.node("BitwiseAnd", [codes, g.const(15, np.uint8)], f"{name}/low")
        high = g.node("BitShift", [codes, g.const(4, np.uint8)], f"{name}/high", direction="RIGHT")
        pairs = g.node("Concat", [g.node("Unsqueeze", [low, g.const([-1])], f"{name}/low1"),
                                  g.node("Unsqueeze", [high, g.const([-1])], f"{name}/high1")], f"{name}/pairs", axis=-1)
        codes = g.node("Reshape", [pairs, g.const([0, 0, p.blocks, p.block_size])], f"{name}/codes")
    q = g.node("Cast", [codes], f"{name}/float", to=TensorProto.FLOAT)
    q = g.node("Sub", [q, g.const(float(1 << (p.bits - 1)), np.float32)], f"{name}/centre")
    d = g.node("Unsqueeze", [g.node("Gather", [w.scales_f32, index], f"{name}/d", axis=0), g.const([-1])],
               f"{name}/d1")  # [B, T, blocks, 1]
    rows = g.node("Mul", [q, d], f"{name}/scaled")
    if p.m is not None:
        mins = centred_mins(g, w, f"{name}/mins")
        m = g.node("Unsqueeze", [g.node("Gather", [mins, index], f"{name}/m", axis=0), g.const([-1])],
                   f"{name}/m1")
        rows = g.node("Add", [rows, m], f"{name}/shifted")
    return g.node("Reshape", [rows, g.const([0, 0, p.k_pad])], f"{name}/flat_rows")


