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
from py_engine.quant.ggml import GGMLWeight

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
    the layer reads its input channels in act-order). A GGUF's blocks (GGMLWeight) give their export form:
    4 or 8 bits in blocks of 32, exact or re-quantized (GGMLWeight.export_form; ggml_notes says which)."""
    if getattr(module, "per_row", False):
        raise ExportError(f"{type(module).__name__} quantizes activations too (W8A8), which MatMulNBits does not")
    blocks = ggml_blocks(module)
    if blocks is not None:
        return export_form(blocks)[0]
    q = getattr(module, "qweight", None)
    if not isinstance(q, QuantizedWeight):
        return module.weight
    perm = getattr(module, "perm", None)
    return q if perm is None else PermutedWeight(q, perm.cpu())


def ggml_blocks(module: nn.Module) -> GGMLWeight | None:
    """The GGUF blocks a QuantLinear (or a QuantEmbedding's table) holds, else None."""
    rows = getattr(module, "rows", None)  # a QuantEmbedding: its table's QuantLinear
    packed = getattr(rows if rows is not None else module, "packed", None)
    return packed if isinstance(packed, GGMLWeight) else None


def export_form(w: GGMLWeight) -> tuple[QuantizedWeight, dict]:
    """GGMLWeight.export_form, made once per weight (a tied table is read as the head and the embedding)."""
    form = getattr(w, "_export_form", None)
    if form is None:
        form = w.export_form()
        object.__setattr__(w, "_export_form", form)
    return form


def ggml_notes(model: nn.Module) -> list[dict]:
    """Per GGUF block type of the model: its tensors' export form, and for re-quantized ones the worst
    absolute and relative RMS error against the file's weights (logged by export_model, kept in the metadata)."""
    seen, by_type = set(), {}
    for module in model.modules():
        w = ggml_blocks(module)
        if w is None or id(w) in seen:
            continue
        seen.add(id(w))
        note = export_form(w)[1]
        entry = by_type.setdefault(note["type"], {**note, "tensors": 0})
        entry["tensors"] += 1
        for key in ("max_abs_error", "relative_rms_error"):
            if key in note:
                entry[key] = max(entry[key], note[key])
    return list(by_type.values())


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
    if all(isinstance(w, QuantizedWeight) for w in weights) and len({w.bits for w in weights}) > 1 and all(
            w.bits in (4, 8) for w in weights):  # a Q4_K_M layer: Q4_K q/k beside a Q6_K v; 4-bit codes are 8-bit ones
        weights = [w.as_centred_int8() for w in weights]
    first = weights[0]
    same = all(isinstance(w, QuantizedWeight) and (w.bits, w.block_size, w.in_features)
               == (first.bits, first.block_size, first.in_features) for w in weights)
    if not same:
        raise ExportError(f"{name}: the projections fused here are quantized differently "
                          f"({', '.join(_describe(w) for w in weights)}); the graph needs one layout")
    offsets = None
    if any(w.offsets is not None for w in weights):  # GGUF Q4_1 (or Q4_K) beside others
        # a part with integer zero points folds them into offsets: (q - z) s = q s + (-z s), exact for a GGUF's
        # types (small integers times fp16-made scales), so every part packs with zero points 0
        weights = [w if w.offsets is not None or not bool(w.zero_points.any()) else replace(
            w, zero_points=torch.zeros_like(w.zero_points), offsets=-(w.zero_points.float() * w.scales.float()))
            for w in weights]
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
