"""Round-to-nearest (RTN) block quantization of a linear layer's weight.

A weight W [N, K] (out features, in features, as `nn.Linear` stores it) is cut
along K into blocks of `block_size`; each block of each output row gets a
scale s and an integer zero point z, and each value becomes the code
q = clamp(round(w / s + z), 0, 2**bits - 1), so that w ~ (q - z) * s.

The arithmetic copies onnxruntime's MLAS blockwise quantizer (the reference
`MatMulNBitsQuantizer` calls it) step for step in float32, so the same
weights give the same bytes, which the export tests check bit for bit:
- symmetric: s = m / -2**(bits-1), m the block value of largest magnitude
  (its sign kept, the negative one on a tie), z = 2**(bits-1); the extreme
  value lands on code 0, the full range is used on one side;
- asymmetric: the range [min(w, 0), max(w, 0)] maps to [0, 2**bits - 1],
  s = (max - min) / (2**bits - 1), z = round(-min / s);
- codes use w * (1 / s) + z, rounded half away from zero (C's roundf).
K is zero-padded up to a whole number of blocks, as onnxruntime does.
Per-channel int8 is `block_size=None` (one block spanning K).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class QuantizedWeight:
    """Codes, scales and zero points of W [N, K] in blocks along K."""

    codes: Tensor  # [N, blocks * block_size] uint8 in [0, 2**bits - 1], K zero-padded
    scales: Tensor  # [N, blocks] float32
    zero_points: Tensor  # [N, blocks] uint8; all 2**(bits-1) when symmetric
    bits: int
    block_size: int
    in_features: int  # K before padding
    symmetric: bool
    # [N, blocks] float32 added after scaling, w = (q - z) * s + offset: llama.cpp's Q4_1 keeps a float minimum
    # per group (w = d * q + m: z = 0, offset = m), which no integer zero point holds exactly. None: no offset.
    offsets: Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def blocks(self) -> int:
        return self.scales.shape[1]

    def dequantize(self) -> Tensor:
        """(q - z) * s (+ offset) as float32 [N, K]."""
        n = self.out_features
        q = self.codes.view(n, self.blocks, self.block_size).float()  # [N, blocks, block]
        z = self.zero_points.float()[:, :, None]  # [N, blocks, 1]
        w = (q - z) * self.scales[:, :, None]  # [N, blocks, block]
        if self.offsets is not None:
            w = w + self.offsets.float()[:, :, None]
        return w.reshape(n, -1)[:, : self.in_features]

    def as_centred_int8(self) -> "QuantizedWeight":
        """The same (q - z) s as 8-bit codes centred on 128: q + t and z + t, t = 128 - 2**(bits-1).

        int8-activation products (MatMulNBits' default zero point 128, the CPU kernels) want codes centred
        there: with a 5-bit code c itself, (c - 128) d x took each activation's rounding error ~7 times over."""
        if self.bits == 8:
            return self
        if not 1 <= self.bits < 8:
            raise ValueError(f"{self.bits}-bit codes do not fit 8 bits")
        t = 128 - 2 ** (self.bits - 1)
        return replace(self, bits=8, codes=self.codes + t, zero_points=self.zero_points + t)


def _round_half_away(x: Tensor) -> Tensor:
    """C's roundf: ties go away from zero (torch.round sends them to even)."""
    r = torch.trunc(x)
    return r + torch.where((x - r).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def block_layout(k: int, block_size: int | None) -> tuple[int, int]:
    """(block, number of blocks) for K inputs cut in blocks of block_size (None: one block of K)."""
    block = block_size or k
    if block < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return block, -(-k // block)


def quantize_rtn(weight: Tensor, bits: int = 4, block_size: int | None = 32,
                 symmetric: bool = True) -> QuantizedWeight:
    """Quantize W [N, K] to `bits` (4 or 8) in blocks of `block_size` along K (None: per channel)."""
    if bits not in (4, 8):
        raise ValueError(f"RTN supports 4 and 8 bits, not {bits}")
    n, k = weight.shape
    block, blocks = block_layout(k, block_size)
    w = torch.zeros(n, blocks * block, dtype=torch.float32)
    w[:, :k] = weight.detach().to(device="cpu", dtype=torch.float32)
    w = w.view(n, blocks, block)  # [N, blocks, block]
    top = (1 << bits) - 1
    if symmetric:
        scales, zero = _symmetric_scales(w, bits)
    else:
        scales, zero = _asymmetric_scales(w, top)
    reciprocal = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))  # [N, blocks]
    q = _round_half_away(w * reciprocal[:, :, None] + zero[:, :, None].float()).clamp(0, top)
    return QuantizedWeight(codes=q.to(torch.uint8).view(n, -1), scales=scales, zero_points=zero,
                           bits=bits, block_size=block, in_features=k, symmetric=symmetric)


def _symmetric_scales(w: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """s = m / -2**(bits-1) for m the signed value of largest |w| (the minimum on a tie)."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, blocks]
    m = torch.where(hi.abs() > lo.abs(), hi, lo)
    mid = 1 << (bits - 1)
    scales = m / float(-mid)
    return scales, torch.full(scales.shape, mid, dtype=torch.uint8)


def _asymmetric_scales(w: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """s = (max - min) / top over a range stretched to hold 0; z = roundf(-min / s) in [0, top]."""
    lo = w.amin(dim=-1).clamp(max=0.0)  # [N, blocks]
    hi = w.amax(dim=-1).clamp(min=0.0)
    scales = (hi - lo) / float(top)
    safe = torch.where(scales != 0, scales, torch.ones_like(scales))
    zero_fp = torch.where(scales != 0, 0.0 - lo / safe, lo)
    zero = _round_half_away(zero_fp).clamp(0, top)
    return scales, zero.to(torch.uint8)
