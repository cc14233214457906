"""The quantized matmul kernels' weight layout and their calls, per device.

    packed = PackedWeight.pack(qweight)      # once, at quantization or load time
    y = quant_matmul([packed], x, [bias])    # x [..., K] -> [..., N], in x's dtype

CPU (x86-64 with AVX2): py_engine/kernels/quant.c on the kernels' thread
pool. Measured on this 2-core AVX2 EPYC (Zen, no AVX-512/VNNI), torch 2.13,
Qwen2.5-0.5B's shapes, one token (M = 1); benchmarks/quant_kernels.py:
- `aten._weight_int8pack_mm`: 1.0 GB/s of int8 weights with fp32 x (a scalar
  loop), 7-13 GB/s with bf16 x on one thread, 6.4 GB/s on the 136 MB LM head;
  at 2 threads its OpenMP region waited ~8 ms per call on the busy machine.
- `aten._weight_int4pack_mm_for_cpu`: 0.3 GB/s fp32, 2-3.5 GB/s bf16.
- `torch._int_mm`: ~1.5 GOP/s (no vectorized int8 GEMM on CPU): 49 ms for
  [17, 896] x [896, 4864]; fp32 MKL takes 0.5 ms.
- prefill (M = 128, [4864, 896]): int8pack/int4pack bf16 27 ms, fp32 MKL 14 ms.
Memory allowed ~30 GB/s (the fp32 kernel on the LM head, idle machine), and
llama.cpp's Q8_0 rate needs ~26 GB/s of int8 weights, so none of these can
reach it. quant.c reads the codes with int8 dot products on x rounded per 32
values (llama.cpp's Q8_0 x Q4_0 scheme): on the idle machine the LM head
streamed at 20-23 GB/s in int8, the decoder's matrices at 19-22. Multiplying
the dequantized codes by fp32 x instead (the exact path, `int8_activations=False`)
was 1.4x (int8) and 2.1x (int4) slower per core in cache, 1.6x and 2.5x on
streamed weights under load: FMA on converted codes costs twice the
instructions per weight. Rounding x adds a relative error of ~0.5% (1.1% with
1% outlier channels) to a layer's output, against 0.8% (int8) and 10% (int4
g128) from the weights themselves. Every count of rows rounds x the same way and
sums each output in one order (quant.h's canonical sum: qtile.c's virtual panels,
and qpanel.c's packed panels for prompt chunks on AVX-512 VNNI builds), so a
row's output is the same bits alone, in a batch or in a prompt chunk (issue 32:
before, chunks of 32+ rows ran MKL's sgemm on exact x). The kernels' build is
the best instruction-set variant the CPU has (py_engine.kernels.VARIANTS):
vpdpbusd with AVX-512 VNNI, maddubs on AVX2.
CUDA: the Triton kernel py_engine/gpu/quant_matmul.py reads this layout as
it is (every bit width and group); without Triton, torch's
`_weight_int8pack_mm` (int8 per channel, symmetric) and `_weight_int4pack_mm`
(4-bit groups of 32-256); anything else, and MPS, dequantizes then multiplies.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import CpuKernels, cpu_kernels
from .ggml import GGMLWeight
from .rtn import QuantizedWeight, block_layout

SUB = 32  # columns per sub-block: one int8 dot product (quant.c)


@dataclass
class PackedWeight:
    """A QuantizedWeight in quant.c's layout; `unpack()` gives the same bytes back."""

    codes: Tensor  # [N, nb * 16] (bits <= 4, two codes a byte) or [N, nb * 32] int8-as-uint8 (code - 128)
    scales: Tensor  # [N, ng] float32
    # [N, ng] uint8; one zero point for every group (symmetric layouts: GGUF's Q4_0 and Q8_0, symmetric RTN) is
    # held as one byte broadcast (stride 0): see `zero`
    zero_points: Tensor
    # [N, ng] float32 s * z' (z' = z, or z - 128 for 8 bits) for per-group zero points; None when all z' are 0
    # or there is one zero point (quant.c takes s * z' from the scales then)
    mins: Tensor | None
    bits: int
    block_size: int
    in_features: int
    symmetric: bool
    spg: int  # sub-blocks per group
    offsets: Tensor | None = None  # [N, ng] float32 (QuantizedWeight.offsets); folded into mins, zeros unused

    @staticmethod
    def packable(q: QuantizedWeight) -> bool:
        """Whether quant.c takes this layout: groups of whole sub-blocks, or one group a row."""
        return q.bits in (2, 3, 4, 8) and (q.block_size % SUB == 0 or q.blocks == 1)

    @classmethod
    def pack(cls, q: QuantizedWeight, consume: bool = False) -> "PackedWeight":
        """With consume, 8-bit codes are rewritten in place (q's codes are then no longer valid): the
        136 MB LM head of Qwen2.5-0.5B is not held twice."""
        if not cls.packable(q):
            raise ValueError(f"no kernel layout for {q.bits}-bit groups of {q.block_size}")
        n, padded = q.codes.shape
        nb = -(-padded // SUB)
        codes = q.codes.cpu()
        if nb * SUB != padded:  # one group a row, K not a multiple of 32: x is zero there
            codes = F.pad(codes, (0, nb * SUB - padded))
        if q.bits <= 4:
            halves = codes.view(n, nb, 2, 16)  # [N, nb, 2, 16]: columns 0-15, 16-31 of each sub-block
            codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, nb * 16)
            offset = 0
        else:
            same = consume and codes.data_ptr() == q.codes.data_ptr() and codes.is_contiguous()
            codes = codes.bitwise_xor_(128) if same else codes ^ 128  # code - 128 as an int8's bits
            offset = 128
        offsets = None if q.offsets is None else q.offsets.cpu().float().contiguous()
        return cls.from_parts(codes.contiguous(), q.scales.cpu().float().contiguous(), q.zero_points.cpu(),
                              q.bits, q.block_size, q.in_features, q.symmetric, nb // q.blocks, offsets)

    @classmethod
    def from_parts(cls, codes: Tensor, scales: Tensor, zero_points: Tensor, bits: int, block_size: int,
                   in_features: int, symmetric: bool, spg: int, offsets: Tensor | None = None) -> "PackedWeight":
        """The layout of codes already packed (4-bit: two a byte; 8-bit: code - 128), scales [N, ng] float32
        and zero points [N, ng] (or one, broadcast): one zero point for every group is kept as one byte and
        no mins (Q4_0 held 25 bytes a block of 32 so against the file's 18); per-group ones get mins = s * z'."""
        z = zero_points.cpu()
        first = z.reshape(-1)[:1]
        if z.numel() and bool((z == first).all()):  # one zero point: s * z' comes from the scales
            zero_points, mins = broadcast_zero(int(first), scales.shape), None
        else:
            zero_points = z.contiguous()
            zf = zero_points.float() - (128 if bits == 8 else 0)  # [N, ng]
            mins = (scales * zf).contiguous() if zf.any() else None
        if offsets is not None:  # w = s * c - (s * z' - offset): quant.c's decode paths take it as it is
            if mins is None and one_value(zero_points):  # one z' (0 for Q4_1): s * z' from the scales
                z1 = float(int(zero_points.reshape(-1)[0]) - (128 if bits == 8 else 0))
                mins = None if z1 == 0 else scales * z1
            mins = (-offsets if mins is None else mins - offsets).contiguous()
        return cls(codes.contiguous(), scales.contiguous(), zero_points, mins, bits, block_size, in_features,
                   symmetric, spg, offsets)

    @property
    def zero(self) -> int | None:
        """The zero point of every group when the layout holds one (a broadcast byte), else None."""
        z = self.zero_points
        return int(z.reshape(-1)[0]) if one_value(z) else None

    def unpack(self) -> QuantizedWeight:
        """The QuantizedWeight this was packed from, byte for byte."""
        n = self.codes.shape[0]
        padded = self.scales.shape[1] * self.block_size
        if self.bits <= 4:
            c = self.codes.cpu().view(n, -1, 1, 16)  # [N, nb, 1, 16]
            codes = torch.cat([c & 15, c >> 4], dim=2).reshape(n, -1)
        else:
            codes = self.codes.cpu() ^ 128
        return QuantizedWeight(codes[:, :padded].contiguous(), self.scales.cpu(),
                               self.zero_points.cpu().contiguous(), self.bits, self.block_size, self.in_features,
                               self.symmetric, None if self.offsets is None else self.offsets.cpu())

    def to(self, device: torch.device | str) -> "PackedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        zero = self.zero
        zeros = move(self.zero_points) if zero is None else broadcast_zero(zero, self.zero_points.shape, device)
        return PackedWeight(move(self.codes), move(self.scales), zeros, move(self.mins),
                            self.bits, self.block_size, self.in_features, self.symmetric, self.spg,
                            move(self.offsets))

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def sub_blocks(self) -> int:
        return self.scales.shape[1] * self.spg

    @property
    def nbytes(self) -> int:
        """Bytes held (a broadcast zero point: one; offsets are folded into mins, which the kernels read)."""
        kept = (self.codes, self.scales, self.mins) if self.offsets is not None else (
            self.codes, self.scales, self.zero_points, self.mins)
        return sum(held_bytes(t) for t in kept if t is not None)


def broadcast_zero(zero: int, shape, device: torch.device | str = "cpu") -> Tensor:
    """One uint8 zero point seen as [N, ng] (stride 0: one byte held)."""
    return torch.full((1, 1), zero, dtype=torch.uint8, device=device).expand(*shape)


def one_value(t: Tensor) -> bool:
    """Whether t holds one element (a broadcast view: stride 0 wherever its size is above 1)."""
    return t.numel() > 0 and all(st == 0 or size == 1 for st, size in zip(t.stride(), t.shape))


def held_bytes(t: Tensor) -> int:
    """Bytes a tensor's elements take in memory: one element for a broadcast view of one value."""
    return t.element_size() if one_value(t) else t.numel() * t.element_size()


class QMat(ctypes.Structure):
    """quant.c's qmat_t."""

    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("ng", ctypes.c_int64), ("spg", ctypes.c_int64), ("bits4", ctypes.c_int32),
                ("bias_bf16", ctypes.c_int32), ("zp", ctypes.c_float), ("kind", ctypes.c_int32)]


class QuantPlan:
    """Packed weights that read the same x, as one rk_qlinear_parts call (built once, like LinearPlan).
    `perm` (act-order GPTQ, see linear.py): the weights' columns are x's channels in that order, so the
    call reads x[..., perm]."""

    INT8_BLOCKS, INT8_ROWS, EXACT = 0, 1, 2  # quant.c's modes: how x is taken in the decode path

    def __init__(self, kernels: CpuKernels, weights: Sequence[PackedWeight], biases: Sequence[Tensor | None],
                 mode: int = INT8_BLOCKS, perm: Tensor | None = None) -> None:
        if not kernels.threads:
            kernels.set_threads(torch.get_num_threads())
        self.perm = perm
        self.weights, self.biases = list(weights), [None if b is None else b.contiguous() for b in biases]
        self.k, self.out, self.mode = weights[0].in_features, sum(w.out_features for w in weights), mode
        self._mats = (QMat * len(weights))(*(qmat(w, b) for w, b in zip(self.weights, self.biases)))
        self._fn = kernels.lib.rk_qlinear_parts

    def __call__(self, x: Tensor, gated: bool = False) -> Tensor:
        """x [..., K] fp32 or bf16 on the CPU -> [..., sum of N] in x's dtype; with gated (two parts,
        gate and up, of N each) F.silu(gate) * up [..., N] instead."""
        x = x.contiguous() if self.perm is None else x.index_select(-1, self.perm)  # a contiguous copy
        # gated: the [..., 2 N] product is the call's own (quant.c makes it in column blocks where it can)
        y = torch.empty(*x.shape[:-1], self.out // 2 if gated else self.out, dtype=x.dtype)
        if x.numel() == 0:  # no rows (an empty batch): nothing to call
            return y
        bf16 = int(x.dtype == torch.bfloat16)
        status = self._fn(x.data_ptr(), bf16, len(self.weights), ctypes.addressof(self._mats),
                          None if gated else y.data_ptr(), bf16, x.numel() // self.k, self.k, self.mode,
                          y.data_ptr() if gated else None)
        if status != 0:
            raise RuntimeError(f"rk_qlinear_parts failed ({status}) for x {tuple(x.shape)} {x.dtype}")
        return y


def qmat(w: "PackedWeight | GGMLWeight", b: Tensor | None) -> QMat:
    """quant.c's view of one packed weight: zeros NULL for one zero point (then zp is its z') or a float
    offset (dequantized as s * c - mins, zp 0). A GGMLWeight is its blocks (codes), `kind` its ggml type
    (kquant.c), ng its blocks a row and spg their sub-blocks of 32."""
    bias, bias_bf16 = 0 if b is None else b.data_ptr(), int(b is not None and b.dtype == torch.bfloat16)
    if isinstance(w, GGMLWeight):
        t = w.layout
        return QMat(w.blocks.data_ptr(), 0, 0, 0, bias, w.out_features, w.in_features // t.values, t.values // SUB,
                    0, bias_bf16, 0.0, t.kind)
    zero = None if w.offsets is not None or w.mins is not None else w.zero  # with mins: z' per group
    if w.offsets is None and w.mins is not None and w.zero_points.numel() > 1 and w.zero is not None:
        raise ValueError("a packed weight with one zero point holds no mins (PackedWeight.from_parts)")
    zp = 0.0 if zero is None else float(zero - (128 if w.bits == 8 else 0))
    zeros = 0 if zero is not None or w.offsets is not None else w.zero_points.data_ptr()
    return QMat(w.codes.data_ptr(), w.scales.data_ptr(), 0 if w.mins is None else w.mins.data_ptr(), zeros,
                bias, w.out_features, w.scales.shape[1], w.spg, int(w.bits <= 4), bias_bf16, zp, 0)


def cpu_plan_fits(weights: Sequence[PackedWeight], biases: Sequence[Tensor | None]) -> bool:
    """Whether quant.c can run these as one call: CPU tensors, same K and sub-block count, fp32/bf16 biases."""
    first = weights[0]
    return (len(weights) <= 8 and all(w.codes.is_cpu and w.in_features == first.in_features
                                      and w.sub_blocks == first.sub_blocks for w in weights)
            and all(b is None or (b.is_cpu and b.dtype in (torch.float32, torch.bfloat16)) for b in biases))


def fake_quantize_rows(x: Tensor) -> Tensor:
    """x rounded to a symmetric int8 grid per row (d = max|x| / 127), in float32: W8A8's activations."""
    x = x.float()
    d = x.abs().amax(dim=-1, keepdim=True) / 127.0  # [..., 1]
    q = torch.where(d > 0, torch.round(x / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(x))
    return q.clamp_(-127, 127) * d


def fake_quantize_blocks(x: Tensor, k_padded: int) -> Tensor:
    """x rounded to int8 per 32 values as quant.c's decode path does: its products are exactly
    dequantized W times this (up to float summation order)."""
    k = x.shape[-1]
    xp = F.pad(x.float(), (0, k_padded - k)).unflatten(-1, (-1, SUB))  # [..., nb, 32]
    return fake_quantize_rows(xp).flatten(-2)[..., :k]


def cpu_kernels_for(x: Tensor) -> CpuKernels | None:
    """The CPU kernels when they can take x, else None."""
    if not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    return cpu_kernels()


def quantize_rtn_native(weight: Tensor, bits: int, block_size: int | None, symmetric: bool) -> QuantizedWeight | None:
    """rtn.quantize_rtn's result, byte for byte, from one pass in C (rtn.c's rk_quantize_rtn);
    None where the kernels cannot take the weight (then call quantize_rtn)."""
    kernels = cpu_kernels()
    if kernels is None or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if bits not in (4, 8):
        raise ValueError(f"RTN supports 4 and 8 bits, not {bits}")
    lib = kernels.lib
    if not kernels.threads:
        kernels.set_threads(torch.get_num_threads())
    w = weight.detach().contiguous()
    n, k = w.shape
    block, blocks = block_layout(k, block_size)
    codes = torch.empty(n, blocks * block, dtype=torch.uint8)
    scales = torch.empty(n, blocks, dtype=torch.float32)
    zeros = torch.empty(n, blocks, dtype=torch.uint8)
    status = lib.rk_quantize_rtn(w.data_ptr(), int(w.dtype == torch.bfloat16), n, k, bits, block, int(symmetric),
                                 codes.data_ptr(), scales.data_ptr(), zeros.data_ptr())
    if status != 0:
        raise RuntimeError(f"rk_quantize_rtn failed ({status}) for {tuple(w.shape)}")
    return QuantizedWeight(codes, scales, zeros, bits, block, k, symmetric)
