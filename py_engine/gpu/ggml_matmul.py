"""Weight-only matmul in Triton over ggml's blocks as the file holds them (py_engine/quant/ggml.py's GGMLWeight).

    y = ggml_matmul(x, weight)  # x [M, K] fp32/fp16/bf16, weight: Q5_0 / Q5_1 / Q2_K ... Q6_K -> [M, N]

A program computes a [BM, BN] tile of y over a share of K (split-K when the tiles alone cannot fill
the GPU, as in decode), a sub-block of 32 columns a step: each row's codes for those columns are
gathered from its block (the type's own bit layout, a constexpr branch per type), its scale(s) and
minimum decoded from the block's fp16 fields and packed integer scales, and the weights made in
float32 exactly as gguf.quants.dequantize makes them (s_j = D * c_j, then s_j * q - m_j or
s_j * (q - z): every product exact, see quant/ggml.py), then cast to x's dtype for tl.dot. The block
bytes a step reads are the same cache lines for its 32 columns, so the gathers stream each block
once. Runs under Triton's interpreter (TRITON_INTERPRET=1) for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import dot_precision, multiprocessors
from .quant_matmul import _tiles

Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 6, 7, 10, 11, 12, 13, 14


@triton.jit
def _byte(rows, at, mask):
    """Byte `at` ([C] or a scalar offset) of each row's block: [BN, C] or [BN] as int32."""
    return tl.load(rows + at, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(rows, at, mask):
    """The fp16 at byte `at` of each row's block, as float32: [BN]."""
    bits = _byte(rows, at, mask) | (_byte(rows, at + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _weights(blk, b, nmask, KIND: tl.constexpr):
    """[BN, 32] float32 weights of sub-block b (a scalar) of the blocks at blk ([BN] pointers)."""
    l = tl.arange(0, 32)  # the sub-block's value index
    rows = blk[:, None]
    m2 = nmask[:, None]
    if KIND == 6 or KIND == 7:  # Q5_0 / Q5_1: d (, m), qh[4], qs[16] in Q4_0's nibble order
        QS: tl.constexpr = 6 if KIND == 6 else 8
        low = (_byte(rows, QS + l % 16, m2) >> (4 * (l // 16))[None, :]) & 15
        high = (_byte(rows, QS - 4 + l // 8, m2) >> (l % 8)[None, :]) & 1
        q = (low | (high << 4)).to(tl.float32)
        d = _half(blk, 0, nmask)[:, None]
        if KIND == 6:
            w = d * (q - 16.0)
        else:
            w = d * q + _half(blk, 2, nmask)[:, None]
    elif KIND == 12 or KIND == 13:  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (qh[32],) qs
        QS: tl.constexpr = 16 if KIND == 12 else 48
        q = (_byte(rows, QS + 32 * (b // 2) + l, m2) >> (4 * (b % 2))) & 15
        if KIND == 13:
            q = q | (((_byte(rows, 16 + l, m2) >> b) & 1) << 4)
        x0, x1, x2 = _byte(blk, 4 + b % 4, nmask), _byte(blk, 8 + b % 4, nmask), _byte(blk, 12 + b % 4, nmask)
        sc = tl.where(b < 4, x0 & 63, (x2 & 15) | ((x0 >> 6) << 4))
        mn = tl.where(b < 4, x1 & 63, (x2 >> 4) | ((x1 >> 6) << 4))
        s = _half(blk, 0, nmask) * sc.to(tl.float32)
        m = _half(blk, 2, nmask) * mn.to(tl.float32)
        w = s[:, None] * q.to(tl.float32) - m[:, None]
    else:  # Q2_K / Q3_K / Q6_K: a scale per 16 values, codes in halves of 128
        j = 2 * b + l // 16  # the sub-scale of each value
        h = b // 4
        r = b % 4
        if KIND == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], d
            low = (_byte(rows, 64 * h + 32 * (r % 2) + l, m2) >> (4 * (r // 2))) & 15
            q = low | (((_byte(rows, 128 + 32 * h + l, m2) >> (2 * r)) & 3) << 4)
            c = _byte(rows, 192 + j, m2)
            c = tl.where(c > 127, c - 256, c)
            w = (_half(blk, 208, nmask)[:, None] * c.to(tl.float32)) * (q - 32).to(tl.float32)
        elif KIND == 11:  # Q3_K: hmask[32], qs[64], 12 bytes of 6-bit scales, d
            q = ((_byte(rows, 32 + 32 * h + l, m2) >> (2 * r)) & 3) | (((_byte(rows, l, m2) >> b) & 1) << 2)
            lo4 = (_byte(rows, 96 + j % 8, m2) >> (4 * (j // 8))[None, :]) & 15
            hi2 = (_byte(rows, 104 + j % 4, m2) >> (2 * (j // 4))[None, :]) & 3
            c = (lo4 | (hi2 << 4)) - 32
            w = (_half(blk, 108, nmask)[:, None] * c.to(tl.float32)) * (q - 4).to(tl.float32)
        else:  # Q2_K: scales[16] (4-bit scale, 4-bit min), qs[64], d, dmin
            q = (_byte(rows, 16 + 32 * h + l, m2) >> (2 * r)) & 3
            sm = _byte(rows, j, m2)
            s = _half(blk, 80, nmask)[:, None] * (sm & 15).to(tl.float32)
            w = s * q.to(tl.float32) - _half(blk, 82, nmask)[:, None] * (sm >> 4).to(tl.float32)
    return w


@triton.jit
def _ggml_matmul_kernel(x_ptr, blocks_ptr, part_ptr, M, N, K, steps_per_split, x_s0, b_s0,
                        KIND: tl.constexpr, VALUES: tl.constexpr, BBYTES: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask, nmask = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_s0
    block_rows = blocks_ptr + rn.to(tl.int64) * b_s0  # [BN] each row's first block
    dtype = x_ptr.dtype.element_ty
    acc = tl.full([BM, BN], 0.0, dtype=tl.float32)
    k_begin = split * steps_per_split * 32
    k_end = tl.minimum(k_begin + steps_per_split * 32, K)
    for k0 in range(k_begin, k_end, 32):
        blk = block_rows + (k0 // VALUES) * BBYTES
        w = _weights(blk, (k0 % VALUES) // 32, nmask, KIND).to(dtype)  # [BN, 32]
        cols = k0 + tl.arange(0, 32)
        xt = tl.load(x_rows + cols[None, :], mask=mmask[:, None], other=0.0)
        acc += tl.dot(xt, tl.trans(w), input_precision=PRECISION)
    out = part_ptr + split.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=mmask[:, None] & nmask[None, :])


def ggml_matmul(x: Tensor, weight, split_k: int | None = None) -> Tensor:
    """x [M, K] @ weight.dequantize()^T -> [M, N] in x's dtype (weight: a GGMLWeight on x's device)."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {weight.in_features} inputs")
    t = weight.layout
    x = x.contiguous()
    m, k = x.shape
    n = weight.out_features
    bm, bn, warps = _tiles(max(m, 2), "mma")  # BM 16 at least: tl.dot's minimum
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = k // 32
    if split_k is None:  # four programs an SM (even waves), each share at least 4 steps
        split_k = max(1, min(4 * multiprocessors(x.device) // tiles, steps // 4, 32))
    per_split = triton.cdiv(steps, split_k)
    split_k = triton.cdiv(steps, per_split)  # no empty shares
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    blocks = weight.blocks
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    _ggml_matmul_kernel[grid](x, blocks, part, m, n, k, per_split, x.stride(0), blocks.stride(0), KIND=t.kind,
                              VALUES=t.values, BBYTES=t.nbytes, BM=bm, BN=bn, PRECISION=dot_precision(x.dtype),
                              num_warps=warps)
    return (part[0] if split_k == 1 else part.sum(0)).to(x.dtype)
