"""Group-wise integer grids for the calibrated methods: 2, 3, 4 and 8 bits.

The same arithmetic as `quantize_rtn` (onnxruntime's MLAS quantizer; at 4 and 8 bits the
codes are byte for byte those of `quantize_rtn`), for any bit width, and split in the
steps AWQ and GPTQ need: grid parameters of a group (`grid_params`), codes of columns
on a given grid (`to_codes`), fake quantization of a whole matrix (`fake_quantize`),
and the final `QuantizedWeight` (`quantize_groups`).

- symmetric: s = m / -2**(bits-1), m the group's signed value of largest magnitude,
  z = 2**(bits-1);
- asymmetric: [min(w, 0), max(w, 0)] onto [0, 2**bits - 1], z = roundf(-min / s);
- q = clamp(roundf(w * (1 / s) + z), 0, 2**bits - 1), w ~ (q - z) * s.
Groups run along the input dimension K; the last one is shorter when K is not a
multiple of the group size (zero-padded in the codes, as `QuantizedWeight` stores it).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .rtn import QuantizedWeight, _round_half_away

__all__ = ["fake_quantize", "from_grid", "grid_params", "quantize_groups", "reciprocal", "to_codes"]

BITS = (2, 3, 4, 8)


def grid_params(w: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor]:
    """(scale, zero) [..., 1] of the grid for the values of w [..., n] along its last dimension."""
    if bits not in BITS:
        raise ValueError(f"group quantization supports bits {BITS}, not {bits}")
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)  # [..., 1]
    if symmetric:
        m = torch.where(hi.abs() > lo.abs(), hi, lo)
        mid = 1 << (bits - 1)
        return m / float(-mid), torch.full_like(m, float(mid))
    top = (1 << bits) - 1
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    scale = (hi - lo) / float(top)
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    zero = torch.where(scale != 0, 0.0 - lo / safe, lo)
    return scale, _round_half_away(zero).clamp(0, top)


def reciprocal(scale: Tensor) -> Tensor:
    """1 / s, and 0 where s is 0 (an all-zero group: every value lands on the zero point)."""
    return torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))


def to_codes(w: Tensor, scale: Tensor, zero: Tensor, bits: int, inverse: Tensor | None = None) -> Tensor:
    """Codes (float, integral) of w on the grid (scale, zero), broadcast against w.

    roundf then clamp to [0, top] is floor(x) + (x - floor(x) >= 0.5) then the clamp: the
    same for every x (below 0 both clamp to 0) in four ops instead of seven.
    """
    x = w * (reciprocal(scale) if inverse is None else inverse) + zero
    f = torch.floor(x)
    return (f + (x - f >= 0.5)).clamp_(0, (1 << bits) - 1)


def _grouped(w: Tensor, group: int) -> Tensor:
    """w [N, K] -> [N, groups, group], zero-padded along K."""
    n, k = w.shape
    groups = -(-k // group)
    if groups * group != k:
        w = torch.cat([w, w.new_zeros(n, groups * group - k)], dim=1)
    return w.view(n, groups, group)


def fake_quantize(w: Tensor, bits: int, group_size: int | None, symmetric: bool) -> Tensor:
    """(q - z) * s of W [N, K] in w's dtype: what the quantized layer will compute with."""
    k = w.shape[1]
    g = _grouped(w.float(), group_size or k)  # [N, groups, group]
    scale, zero = grid_params(g, bits, symmetric)
    return ((to_codes(g, scale, zero, bits) - zero) * scale).view(w.shape[0], -1)[:, :k].to(w.dtype)


def quantize_groups(w: Tensor, bits: int, group_size: int | None, symmetric: bool) -> QuantizedWeight:
    """The QuantizedWeight of W [N, K] on its own group grids (RTN of whatever W now holds)."""
    n, k = w.shape
    group = group_size or k
    g = _grouped(w.detach().to(device="cpu", dtype=torch.float32), group)  # [N, groups, group]
    scale, zero = grid_params(g, bits, symmetric)
    codes = to_codes(g, scale, zero, bits)
    return QuantizedWeight(codes=codes.to(torch.uint8).view(n, -1), scales=scale[..., 0],
                           zero_points=zero[..., 0].to(torch.uint8), bits=bits, block_size=group,
                           in_features=k, symmetric=symmetric)


def from_grid(codes: Tensor, scales: Tensor, zeros: Tensor, bits: int, group: int, symmetric: bool,
              in_features: int) -> QuantizedWeight:
    """A QuantizedWeight from codes [N, K] and per-group scales/zeros [N, groups] (GPTQ's output)."""
    n, k = codes.shape
    padded = torch.zeros(n, scales.shape[1] * group, dtype=torch.uint8)
    padded[:, :k] = codes.to(device="cpu", dtype=torch.uint8)
    return QuantizedWeight(codes=padded, scales=scales.to(device="cpu", dtype=torch.float32).contiguous(),
                           zero_points=zeros.to(device="cpu", dtype=torch.uint8),
                           bits=bits, block_size=group, in_features=in_features, symmetric=symmetric)
