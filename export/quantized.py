"""Weights of an already-quantized model (py_engine QuantLinear: AWQ, GPTQ, RTN) for the graph.

The exporter reads a layer's weight through `layer_weight`: a float tensor for an nn.Linear, the
layer's own `QuantizedWeight` (codes, scales, zero points) for a QuantLinear, which export.linear
packs for MatMulNBits unchanged. Projections the graph fuses (q/k/v, gate/up) concatenate their
codes along the output channels, which needs the same bits and groups; a per-channel weight (the
int8 LM head) whose input width is not a power of two is re-cut into power-of-two blocks that repeat
its scale, since MatMulNBits blocks are powers of two >= 16. Both are exact.

An act-order GPTQ layer (QuantLinear.perm) holds its codes over the input channels in the order perm;
`layer_weight` gives it as a `PermutedWeight` and export.linear gathers x[..., perm] before the
MatMulNBits (a plain Gather, which every runtime has, rather than MatMulNBits' optional g_idx input,
which the contrib-op spec marks deprecated). Fused projections share one Gather, so their perms must
be equal (q/k/v of one checkpoint have equal g_idx); different ones are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from py_engine.quant import QuantizedWeight

from .options import PRECISION_BITS, ExportError, unsupported_bits

# What MatMulNBits runs (3-bit codes would fit 4-bit blocks exactly, at 4-bit size: not done).
MATMUL_NBITS_BITS = tuple(sorted(PRECISION_BITS.values()))
PER_CHANNEL_BLOCK = 128  # block used for a per-channel weight whose width is not a power of two


@dataclass(frozen=True)
class PermutedWeight:
    """An act-order layer's weight: `weight` holds W[:, perm], so the graph multiplies x[..., perm] by it."""

    weight: QuantizedWeight
    perm: Tensor  # int64 [K], on the CPU


Weight = Tensor | QuantizedWeight | PermutedWeight


def layer_weight(module: nn.Module) -> Weight:
    """A Linear's float weight, or a weight-only quantized layer's QuantizedWeight (a PermutedWeight when
    the layer reads its input channels in act-order)."""
    if getattr(module, "per_row", False):
        raise ExportError(f"{type(module).__name__} quantizes activations too (W8A8), which MatMulNBits does not")
    q = getattr(module, "qweight", None)
    if not isinstance(q, QuantizedWeight):
        return module.weight
    perm = getattr(module, "perm", None)
    return q if perm is None else PermutedWeight(q, perm.cpu())


def concat(weights: list[Weight], name: str) -> Weight:
    """Weights stacked along the output channels ([sum N, K])."""
    if any(isinstance(w, PermutedWeight) for w in weights):
        first = weights[0]
        if not all(isinstance(w, PermutedWeight) and torch.equal(w.perm, first.perm) for w in weights):
            raise ExportError(f"{name}: the projections fused here read their input channels in different act-order "
                              "permutations (GPTQ g_idx), and the graph gathers x once for them; export needs equal "
                              "g_idx across them")
        return PermutedWeight(concat([w.weight for w in weights], name), first.perm)
    if not any(isinstance(w, QuantizedWeight) for w in weights):
        return torch.cat(weights)
    first = weights[0]
    same = all(isinstance(w, QuantizedWeight) and (w.bits, w.block_size, w.in_features)
               == (first.bits, first.block_size, first.in_features) for w in weights)
    if not same:
        raise ExportError(f"{name}: the projections fused here are quantized differently "
                          f"({', '.join(_describe(w) for w in weights)}); the graph needs one layout")
    offsets = None
    if any(w.offsets is not None for w in weights):  # GGUF Q4_1 beside others: 0 is no offset
        offsets = torch.cat([w.offsets.float() if w.offsets is not None else torch.zeros(w.scales.shape)
                             for w in weights])
    return QuantizedWeight(codes=torch.cat([w.codes for w in weights]), scales=torch.cat([w.scales for w in weights]),
                           zero_points=torch.cat([w.zero_points for w in weights]), bits=first.bits,
                           block_size=first.block_size, in_features=first.in_features,
                           symmetric=all(w.symmetric for w in weights), offsets=offsets)


def _describe(w: Tensor | QuantizedWeight) -> str:
    return f"{w.bits}-bit block {w.block_size}" if isinstance(w, QuantizedWeight) else "float"


def for_matmul_nbits(q: QuantizedWeight, name: str, per_channel_block: int = PER_CHANNEL_BLOCK) -> QuantizedWeight:
    """q on the CPU, with power-of-two blocks (a per-channel weight re-cut into `per_channel_block`: the web
    target's 32, the page's kernels' block); bits MatMulNBits cannot take are refused."""
    if q.bits not in MATMUL_NBITS_BITS:
        raise ExportError(unsupported_bits(name, q.bits))
    q = replace(q, codes=q.codes.cpu(), scales=q.scales.cpu().float(), zero_points=q.zero_points.cpu(),
                offsets=None if q.offsets is None else q.offsets.cpu().float())
    block = q.block_size
    if block >= 16 and not block & (block - 1):
        return q
    if q.blocks != 1:
        raise ExportError(f"{name} has groups of {block}; MatMulNBits blocks are powers of two >= 16")
    new = per_channel_block if q.in_features >= per_channel_block else max(16, 1 << (q.in_features - 1).bit_length())
    blocks = -(-q.in_features // new)
    codes = torch.zeros(q.out_features, blocks * new, dtype=torch.uint8)
    codes[:, : q.in_features] = q.codes[:, : q.in_features]
    return replace(q, codes=codes, scales=q.scales.expand(-1, blocks).contiguous(),
                   zero_points=q.zero_points.expand(-1, blocks).contiguous(), block_size=new,
                   offsets=None if q.offsets is None else q.offsets.expand(-1, blocks).contiguous())
