"""Weight-only quantized matmul in Triton, reading `PackedWeight` (quant/kernels.py) as QuantLinear holds it.

    y = quant_matmul(x, packed)  # x [M, K] fp32/fp16/bf16 -> [M, N] in x's dtype; W = (q - z) * s

The layout, per output row: K is cut in sub-blocks of 32 columns. 2/3/4-bit
codes take 16 bytes a sub-block, byte j holding column j in its low nibble and
column j + 16 in its high one; 8-bit codes take 32 bytes, each code - 128 as
an int8. Scales [N, groups] fp32 and zero points [N, groups] uint8 hold one
value per group of `block_size` columns (or one group a row); one zero point for
every group (symmetric layouts) is one byte read through zero strides.

A program computes a [BM, BN] tile of y over a share of K (split-K when the
tiles alone cannot fill the GPU, as in decode, where M is 1; the shares'
fp32 partials are summed after). Each step takes BK columns: the codes, the
scale and zero point of their one group (BK divides the group size, so a step
never straddles groups), dequantized in registers to x's dtype, then tl.dot.
A 4-bit step never interleaves nibbles back into column order: its low and
high nibbles are two [BN, BK/2] tiles, each multiplied with the x columns they
hold. Up to GEMV_ROWS rows of 8-bit codes (decode) take a GEMV kernel instead,
a program per row, multiply-adds in fp32 and no tensor cores (pick_kernel: on
an H100 it wins for int8 and loses for int4, whose tl.dot path with BM = 16,
tl.dot's minimum, streams the codes faster).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import dot_precision, multiprocessors
from .combine import sum_combine

SUB = 32  # columns per sub-block (quant/kernels.py's SUB)
ONE_GROUP = 1 << 30  # a group size no column index reaches: one group a row
GEMV_ROWS = 4  # up to this many rows of x, one program per row and no tensor cores


@triton.jit
def _dequant(codes, scale, zero_scaled, DTYPE: tl.constexpr):
    """(q - z) * s as q * s - z * s, one multiply-add per weight: [BN, C] codes, [BN] scale and z * s."""
    return (codes.to(tl.float32) * scale[:, None] - zero_scaled[:, None]).to(DTYPE)


@triton.jit
def _quant_matmul_kernel(x_ptr, codes_ptr, scales_ptr, zeros_ptr, offsets_ptr, part_ptr, M, N, K, K_CODES,
                         steps_per_split, x_s0, c_s0, s_s0, z_s0, z_s1, o_s0,
                         GROUP: tl.constexpr, BITS4: tl.constexpr, OFFSETS: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask, nmask = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_s0
    code_rows = codes_ptr + rn.to(tl.int64)[:, None] * c_s0
    dtype = x_ptr.dtype.element_ty
    acc = tl.full([BM, BN], 0.0, dtype=tl.float32)
    k_begin = split * steps_per_split * BK
    k_end = tl.minimum(k_begin + steps_per_split * BK, K_CODES)
    for k0 in range(k_begin, k_end, BK):
        group = k0 // GROUP
        scale = tl.load(scales_ptr + rn * s_s0 + group, mask=nmask, other=0.0)  # [BN]
        zero_scaled = tl.load(zeros_ptr + rn * z_s0 + group * z_s1, mask=nmask, other=0).to(tl.float32) * scale
        if OFFSETS:  # w = (q - z) s + offset (GGUF Q4_1's per-block minimum)
            zero_scaled -= tl.load(offsets_ptr + rn * o_s0 + group, mask=nmask, other=0.0)
        if BITS4:
            j = tl.arange(0, BK // 2)
            low = k0 + (j // 16) * 32 + j % 16  # the columns held by low nibbles; high ones are + 16
            byte = tl.load(code_rows + (k0 // 2 + j)[None, :], mask=nmask[:, None] & (low < K_CODES)[None, :],
                           other=0)  # [BN, BK/2] uint8
            w_low = _dequant(byte & 15, scale, zero_scaled, dtype)
            w_high = _dequant(byte >> 4, scale, zero_scaled, dtype)
            x_low = tl.load(x_rows + low[None, :], mask=mmask[:, None] & (low < K)[None, :], other=0.0)
            x_high = tl.load(x_rows + (low + 16)[None, :], mask=mmask[:, None] & (low + 16 < K)[None, :], other=0.0)
            acc += tl.dot(x_low, tl.trans(w_low), input_precision=PRECISION)
            acc += tl.dot(x_high, tl.trans(w_high), input_precision=PRECISION)
        else:
            cols = k0 + tl.arange(0, BK)
            byte = tl.load(code_rows + cols[None, :], mask=nmask[:, None] & (cols < K_CODES)[None, :], other=128)
            w = _dequant(byte.to(tl.int32) ^ 128, scale, zero_scaled, dtype)  # the byte holds code - 128
            xt = tl.load(x_rows + cols[None, :], mask=mmask[:, None] & (cols < K)[None, :], other=0.0)
            acc += tl.dot(xt, tl.trans(w), input_precision=PRECISION)
    out = part_ptr + split.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _quant_gemv_kernel(x_ptr, codes_ptr, scales_ptr, zeros_ptr, offsets_ptr, part_ptr, M, N, K, K_CODES,
                       steps_per_split, x_s0, c_s0, s_s0, z_s0, z_s1, o_s0,
                       GROUP: tl.constexpr, BITS4: tl.constexpr, OFFSETS: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr):
    """One row of x (decode), no tensor cores, so no dequantized tile to stage for them. Within a
    step's one group, sum_k (q_k - z) s x_k = s (sum_k q_k x_k) - z s (sum_k x_k): the products
    q_k x_k s accumulate in a [BN, C] tile and are summed across its columns once, at the end."""
    row, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    x_row = x_ptr + row.to(tl.int64) * x_s0
    code_rows = codes_ptr + rn.to(tl.int64)[:, None] * c_s0
    C: tl.constexpr = BK // 2 if BITS4 else BK
    acc = tl.full([BN, C], 0.0, dtype=tl.float32)
    zero_terms = tl.full([BN], 0.0, dtype=tl.float32)
    k_begin = split * steps_per_split * BK
    k_end = tl.minimum(k_begin + steps_per_split * BK, K_CODES)
    for k0 in range(k_begin, k_end, BK):
        group = k0 // GROUP
        scale = tl.load(scales_ptr + rn * s_s0 + group, mask=nmask, other=0.0)  # [BN]
        zero = tl.load(zeros_ptr + rn * z_s0 + group * z_s1, mask=nmask, other=0).to(tl.float32)
        if BITS4:
            j = tl.arange(0, BK // 2)
            low = k0 + (j // 16) * 32 + j % 16  # the columns held by low nibbles; high ones are + 16
            byte = tl.load(code_rows + (k0 // 2 + j)[None, :], mask=nmask[:, None] & (low < K_CODES)[None, :],
                           other=0)  # [BN, BK/2] uint8
            x_low = tl.load(x_row + low, mask=low < K, other=0.0).to(tl.float32)
            x_high = tl.load(x_row + low + 16, mask=low + 16 < K, other=0.0).to(tl.float32)
            products = (byte & 15).to(tl.float32) * x_low[None, :] + (byte >> 4).to(tl.float32) * x_high[None, :]
            x_sum = tl.reduce(x_low + x_high, 0, sum_combine)
        else:
            cols = k0 + tl.arange(0, BK)
            byte = tl.load(code_rows + cols[None, :], mask=nmask[:, None] & (cols < K_CODES)[None, :], other=128)
            xt = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            products = (byte.to(tl.int32) ^ 128).to(tl.float32) * xt[None, :]  # the byte holds code - 128
            x_sum = tl.reduce(xt, 0, sum_combine)
        acc += products * scale[:, None]
        zero_scaled = zero * scale
        if OFFSETS:  # w = (q - z) s + offset (GGUF Q4_1's per-block minimum)
            zero_scaled -= tl.load(offsets_ptr + rn * o_s0 + group, mask=nmask, other=0.0)
        zero_terms += zero_scaled * x_sum
    out = tl.reduce(acc, 1, sum_combine) - zero_terms
    tl.store(part_ptr + split.to(tl.int64) * M * N + row.to(tl.int64) * N + rn, out, mask=nmask)


def _step_columns(block_size: int, groups: int) -> tuple[int, int]:
    """(BK, GROUP): columns per step and the group size the kernel divides by (ONE_GROUP for one a row)."""
    if groups == 1:
        return 128, ONE_GROUP
    bk = SUB
    while bk * 2 <= 128 and block_size % (bk * 2) == 0:
        bk *= 2
    return bk, block_size


def pick_kernel(m: int, bits: int) -> str:
    """GEMV for a few rows of 8-bit codes, tl.dot ("mma") otherwise. Measured on an H100 (CUDA-graph
    replays, Llama-3-8B MLP shapes, one row): int8 GEMV 0.035 ms against 0.038-0.041 ms for mma;
    int4 mma 0.031-0.034 ms against 0.039-0.043 ms for GEMV (benchmarks/results/gpu_bench.json)."""
    return "gemv" if m <= GEMV_ROWS and bits == 8 else "mma"


def _tiles(m: int, kernel: str) -> tuple[int, int, int]:
    """(BM, BN, num_warps) by rows of x: decode's few rows stream the codes (BM 1: the GEMV kernel, a
    program per row), prefill's many reuse them."""
    if kernel == "gemv":
        return 1, 32, 4
    if m <= 16:
        return 16, 64, 4
    if m <= 64:
        return 64, 64, 4
    return 128, 64, 8


def quant_matmul(x: Tensor, packed, split_k: int | None = None, kernel: str | None = None) -> Tensor:
    """x [M, K] @ dequantize(packed)^T -> [M, N] in x's dtype (packed: quant.kernels.PackedWeight on x's
    device). kernel: "gemv" or "mma" (tl.dot) to force one; None picks by M."""
    if x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {packed.in_features} inputs")
    if packed.bits not in (2, 3, 4, 8):
        raise ValueError(f"no Triton kernel for {packed.bits}-bit codes")
    x = x.contiguous()
    m, k = x.shape
    n = packed.out_features
    groups = packed.scales.shape[1]
    bk, group = _step_columns(packed.block_size, groups)
    k_codes = packed.sub_blocks * SUB
    bm, bn, warps = _tiles(m, kernel or pick_kernel(m, packed.bits))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = triton.cdiv(k_codes, bk)
    if split_k is None:  # four programs an SM (even waves), each share at least 4 steps
        split_k = max(1, min(4 * multiprocessors(x.device) // tiles, steps // 4, 32))
    per_split = triton.cdiv(steps, split_k)
    split_k = triton.cdiv(steps, per_split)  # no empty shares
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    offsets = packed.offsets.contiguous() if packed.offsets is not None else packed.scales  # unread without
    args = (x, packed.codes, packed.scales, packed.zero_points, offsets, part, m, n, k, k_codes, per_split,
            x.stride(0), packed.codes.stride(0), packed.scales.stride(0), *packed.zero_points.stride(),
            offsets.stride(0))
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    flags = dict(GROUP=group, BITS4=packed.bits <= 4, OFFSETS=packed.offsets is not None)
    if bm == 1:
        _quant_gemv_kernel[grid](*args, **flags, BN=bn, BK=bk, num_warps=warps)
    else:
        _quant_matmul_kernel[grid](*args, **flags, BM=bm, BN=bn, BK=bk, PRECISION=dot_precision(x.dtype),
                                   num_warps=warps)
    return (part[0] if split_k == 1 else part.sum(0)).to(x.dtype)
