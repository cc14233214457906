"""Pack a `QuantizedWeight` into the byte layouts of onnxruntime's quantized ops.

MatMulNBits (com.microsoft) computes Y = A @ W^T for W [N, K] held as
    B            [N, blocks, block_size * bits / 8] uint8: the codes of row n,
                 block b, packed low bits first (4 bits: two codes a byte,
                 the earlier k in the low nibble; 2 bits: four codes a byte,
                 the earlier k in the lower bit pairs);
    scales       [N, blocks] float;
    zero_points  [N, ceil(blocks * bits / 8)] uint8, packed the same way
                 along the blocks of a row; omitted when every zero point is
                 2**(bits-1), the op's default (symmetric quantization);
                 or [N, blocks] float, the op's other form, for a weight with
                 a float offset per block (GGUF's Q4_1: w = d q + m is
                 (q - zp) d with zp = -m / d, rounded once more: onnxruntime
                 computes it so, to ~1 ulp of the weight).
GatherBlockQuantized uses the same codes for an embedding table E [V, H]
(rows are tokens, blocks run along H), so a tied embedding and LM head can
share one packed initializer.

Only numpy here: the codes come from any quantizer (RTN, AWQ, GPTQ).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from py_engine.quant import QuantizedWeight


@dataclass(frozen=True)
class PackedNBits:
    """MatMulNBits inputs and attributes for one weight."""

    B: np.ndarray  # [N, blocks, blob] uint8
    scales: np.ndarray  # [N, blocks] float32
    zero_points: np.ndarray | None  # [N, ceil(blocks * bits / 8)] uint8, None when symmetric; float [N, blocks]
    K: int
    N: int
    bits: int
    block_size: int
    offsets: np.ndarray | None = None  # [N, blocks] float32 QuantizedWeight.offsets (zero_points then float)


def pack_codes(codes: np.ndarray, bits: int, pad: int = 0) -> np.ndarray:
    """uint8 codes [..., M] -> bytes [..., ceil(M * bits / 8)], low bits first; a last byte's spare slots get `pad`."""
    if bits == 8:
        return codes.astype(np.uint8)
    if bits not in (2, 4):
        raise ValueError(f"cannot pack {bits}-bit codes")
    per = 8 // bits  # codes a byte
    spare = -codes.shape[-1] % per  # a count of zero points that does not fill the last byte
    if spare:
        codes = np.concatenate([codes, np.full(codes.shape[:-1] + (spare,), pad, np.uint8)], axis=-1)
    groups = codes.astype(np.uint8).reshape(codes.shape[:-1] + (-1, per))  # [..., M/per, per]
    packed = groups[..., 0] & np.uint8((1 << bits) - 1)
    for i in range(1, per):  # bits shifted past the byte drop out, so no mask is needed above
        packed |= groups[..., i] << np.uint8(i * bits)
    return packed


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of pack_codes: bytes [..., B] -> codes [..., count]."""
    if bits == 8:
        return packed[..., :count]
    shifts = np.arange(0, 8, bits, dtype=np.uint8)  # [per]: the earlier code in the lower bits
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)  # [..., B, per]
    return codes.reshape(packed.shape[:-1] + (-1,))[..., :count]


def pack_matmul_nbits(q: QuantizedWeight) -> PackedNBits:
    """The MatMulNBits tensors of a weight quantized in blocks along K."""
    n, blocks, block = q.out_features, q.blocks, q.block_size
    codes = q.codes.numpy().copy()
    codes[:, q.in_features:] = 0  # padding past K is never read; onnxruntime leaves it 0
    codes = codes.reshape(n, blocks, block)  # [N, blocks, block]
    zero = q.zero_points.numpy()
    default = 1 << (q.bits - 1)
    if q.offsets is not None:
        if bool((q.zero_points != 0).any()):
            raise ValueError("weights with float offsets pack with zero points 0 (GGUF Q4_1) only")
        scales, zp = float_zero_points(q, codes)
        return PackedNBits(B=pack_codes(codes, q.bits), scales=scales, zero_points=zp, K=q.in_features, N=n,
                           bits=q.bits, block_size=block, offsets=q.offsets.numpy().astype(np.float32))
    symmetric = bool((zero == default).all())
    return PackedNBits(
        B=pack_codes(codes, q.bits),
        scales=q.scales.numpy().astype(np.float32),
        # onnxruntime fills the spare nibble of an odd block count with the default zero point (its
        # kernel never reads spare slots; 2 bits pad the same way)
        zero_points=None if symmetric else pack_codes(zero, q.bits, pad=default),
        K=q.in_features, N=n, bits=q.bits, block_size=block)


def float_zero_points(q: QuantizedWeight, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scales, zp) [N, blocks] float32 with (c - zp) * s = (c - z) * s + offset: zp = z - offset / s. A block
    whose scale is 0 holds its offset alone, which ggml's quantizer writes with all codes 0: there s = offset
    and zp = -1, exactly."""
    s, offset = q.scales.numpy().astype(np.float32), q.offsets.numpy().astype(np.float32)
    z = q.zero_points.numpy().astype(np.float32)
    flat = s == 0  # [N, blocks]
    if (codes[flat] != 0).any():
        raise ValueError("a block with scale 0 and non-zero codes has no MatMulNBits form")
    with np.errstate(divide="ignore", invalid="ignore"):
        zp = np.where(flat, np.float32(-1.0), z - offset / np.where(flat, np.float32(1.0), s))
    return np.where(flat, offset, s).astype(np.float32), zp.astype(np.float32)
