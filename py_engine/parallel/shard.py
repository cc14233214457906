"""Slices of a projection: some of its output rows (column-parallel) or some of its input columns (row-parallel).

    q_local = take_rows(attn.q_proj, [(lo, hi)])     # [N, K] -> [n, K]: this rank's heads
    o_local = take_cols(attn.o_proj, lo, hi)          # [N, K] -> [N, k]: the inputs those heads give

Each returns a new module of the same kind holding copies of only its slice
(float Linears and their CPU-kernel subclass, QuantLinear, FusedLinear of
either), so the model's forward runs it unchanged. Quantized weights are cut
in their packed layout, codes and scales alike, without being unpacked:
rows are rows, and a column range must start on a quantization group (an
int8/int4 group, a GGUF block of 32) and end on one or at the last column;
one group per row (per-channel scales) cuts at any multiple of 32. A cut
that would split a group, or an act-order GPTQ layer (its columns are
permuted), raises TensorParallelError.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from ..cpu.linears import FusedLinear
from ..models.skeleton import skeleton
from ..quant.kernels import SUB, PackedWeight, broadcast_zero, one_value
from ..quant.linear import QuantLinear, W8A8Linear
from ..quant.rtn import QuantizedWeight
from .layout import TensorParallelError

Ranges = list[tuple[int, int]]


def take_rows(module: nn.Module, ranges: Ranges) -> nn.Module:
    """The output rows in `ranges` (concatenated in order) of a projection."""
    if isinstance(module, FusedLinear):
        return _fused_rows(module, ranges)
    index = torch.cat([torch.arange(lo, hi) for lo, hi in ranges])  # [n] output rows
    if isinstance(module, QuantLinear):
        return _quant_rows(module, ranges, index)
    if isinstance(module, nn.Linear):
        return _linear(module, module.weight.detach()[index], _rows(module.bias, index))
    raise TensorParallelError(f"cannot shard a {type(module).__name__} by output rows")


def take_cols(module: nn.Module, lo: int, hi: int, keep_bias: bool = True) -> nn.Module:
    """The input columns [lo, hi) of a projection; its bias only if keep_bias (a row-parallel layer's
    bias is added once, by rank 0, before the all-reduce sums the partial outputs)."""
    if isinstance(module, FusedLinear):
        return _fused(module, [take_cols(p, lo, hi, keep_bias) for p in module.parts])
    if isinstance(module, QuantLinear):
        return _quant_cols(module, lo, hi, keep_bias)
    if isinstance(module, nn.Linear):
        bias = module.bias.detach().clone() if keep_bias and module.bias is not None else None
        return _linear(module, module.weight.detach()[:, lo:hi], bias)
    raise TensorParallelError(f"cannot shard a {type(module).__name__} by input columns")


def _rows(t: Tensor | None, index: Tensor) -> Tensor | None:
    return None if t is None else t.detach()[index.to(t.device)].contiguous()


def _linear(old: nn.Linear, weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """A Linear of old's class (KernelLinear keeps its kernels) over copies of weight and bias."""
    with skeleton():
        new = type(old)(weight.shape[1], weight.shape[0], bias=bias is not None)
    new.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    new.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
    if hasattr(old, "kernels"):
        new.kernels = old.kernels
    return new


def _fused(old: FusedLinear, parts: list[nn.Module]) -> FusedLinear:
    new = FusedLinear(parts)
    new.kernels = old.kernels
    return new


def _fused_rows(module: FusedLinear, ranges: Ranges) -> FusedLinear:
    """ranges index the concatenated output of the parts; each part keeps the rows that fall in it."""
    parts, start = [], 0
    for part in module.parts:
        n = int(part.out_features)
        mine = [(max(lo, start) - start, min(hi, start + n) - start) for lo, hi in ranges
                if min(hi, start + n) > max(lo, start)]
        if not mine:
            raise TensorParallelError(f"a rank would hold no rows of a fused projection's part of {n} rows")
        parts.append(take_rows(part, mine))
        start += n
    return _fused(module, parts)


# --- quantized layers ------------------------------------------------------------------------------------
def _check_quant(module: QuantLinear) -> None:
    if isinstance(module, W8A8Linear):
        raise TensorParallelError("SmoothQuant (W8A8) layers round each token's whole input to int8 with one "
                                  "scale; a rank holds part of it: not supported with tensor parallelism")


def _quant_rows(module: QuantLinear, ranges: Ranges, index: Tensor) -> QuantLinear:
    _check_quant(module)
    if module.packed is not None:
        p = module.packed
        zeros = (broadcast_zero(p.zero, (len(index), p.scales.shape[1]), p.zero_points.device)
                 if one_value(p.zero_points) else _rows(p.zero_points, index))
        new_weight = replace(p, codes=_rows(p.codes, index), scales=_rows(p.scales, index), zero_points=zeros,
                             mins=_rows(p.mins, index), offsets=_rows(p.offsets, index))
    else:
        q = module._raw
        new_weight = replace(q, codes=_rows(q.codes, index), scales=_rows(q.scales, index),
                             zero_points=_rows(q.zero_points, index), offsets=_rows(q.offsets, index))
    return _quant(module, new_weight, _rows(module.bias, index))


def _quant_cols(module: QuantLinear, lo: int, hi: int, keep_bias: bool) -> QuantLinear:
    _check_quant(module)
    if module.perm is not None:
        raise TensorParallelError("an act-order GPTQ layer holds its inputs permuted (desc_act): it cannot be "
                                  "split by input columns; quantize without act-order for tensor parallelism")
    q = module.packed if module.packed is not None else module._raw
    k = q.in_features
    hi = min(hi, k)
    per_row = q.scales.shape[1] == 1
    unit = SUB if per_row else q.block_size  # per-channel: any whole sub-block
    if lo % unit or (hi % unit and hi != k):
        raise TensorParallelError(f"a layer quantized in groups of {unit} inputs cannot be split at inputs "
                                  f"[{lo}, {hi}) of {k}: the cut would split a group")
    g0, g1 = (0, 1) if per_row else (lo // q.block_size, -(-hi // q.block_size))
    group = slice(g0, g1)
    if module.packed is not None:
        weight = _packed_cols(q, lo, hi, group, per_row)
    else:  # codes one byte per input: the columns of whole groups
        c0, c1 = (lo, hi) if per_row else (g0 * q.block_size, g1 * q.block_size)
        cut = lambda t: None if t is None else t[:, group].contiguous()  # noqa: E731
        weight = replace(q, codes=q.codes[:, c0:c1].contiguous(), scales=cut(q.scales),
                         zero_points=cut(q.zero_points), offsets=cut(q.offsets), in_features=hi - lo,
                         block_size=hi - lo if per_row else q.block_size)
    bias = module.bias.detach().clone() if keep_bias and module.bias is not None else None
    return _quant(module, weight, bias)


def _packed_cols(p: PackedWeight, lo: int, hi: int, group: slice, per_row: bool) -> PackedWeight:
    """Columns [lo, hi) of a packed weight: codes by whole sub-blocks of 32 (16 bytes at 4 bits, 32 at 8)."""
    width = 16 if p.bits <= 4 else 32  # bytes per sub-block
    s0, s1 = lo // SUB, -(-hi // SUB)
    codes = p.codes[:, s0 * width:s1 * width].contiguous()
    cut = lambda t: None if t is None else t[:, group].contiguous()  # noqa: E731
    zeros = (broadcast_zero(p.zero, (p.codes.shape[0], 1 if per_row else group.stop - group.start),
                            p.zero_points.device) if one_value(p.zero_points) else cut(p.zero_points))
    return replace(p, codes=codes, scales=cut(p.scales), zero_points=zeros, mins=cut(p.mins), offsets=cut(p.offsets),
                   in_features=hi - lo, block_size=hi - lo if per_row else p.block_size,
                   spg=s1 - s0 if per_row else p.spg)


def _quant(old: QuantLinear, weight: PackedWeight | QuantizedWeight, bias: Tensor | None) -> QuantLinear:
    new = QuantLinear(weight, bias, consume=True)  # the slices are copies: 8-bit codes may be packed in place
    if old.kernels is not None:
        new.kernels = old.kernels
    if not old.int8_activations:
        new.int8_activations = False
    return new
