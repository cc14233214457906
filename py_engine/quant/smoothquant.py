"""SmoothQuant (Xiao et al., 2022): move activation outliers into the weights so both
quantize to int8 (W8A8).

    smooth_model(model, qconfig, calibration)  # then int8 weights per channel, int8 activations per token

For each linear group that a norm feeds (q/k/v or Phi-3's qkv_proj after input_layernorm;
gate/up or gate_up_proj after the MLP's norm; Mixtral's router and experts), with
X_j the group's input channel j over the calibration tokens and W_j its input column j
over every linear of the group:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)    (both clamped at 1e-5, as the reference)

X diag(s)^-1 is folded into the norm's weight (Gemma's (1 + w) norm: 1 + w' = (1 + w) / s)
and diag(s) W into the linears' input columns, so the float model computes the same thing.
o_proj and down_proj are not smoothed: no norm precedes them (the paper smooths only the
inputs that LayerNorm produces, for OPT and BLOOM and in its Llama port alike); they are
still quantized W8A8. Statistics come from each layer's float inputs, layer by layer.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from .awq import ScaleGroup, apply_scale, scale_groups
from .calibration import LayerwiseCalibration
from .config import QuantConfig

__all__ = ["activation_absmax", "smooth_model", "smoothing_scales"]


class _AbsMax:
    """A forward hook keeping the per-channel max |x| of a module's input."""

    def __init__(self) -> None:
        self.value: Tensor | None = None

    def hook(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        x = inputs[0]
        m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()  # [K]
        self.value = m if self.value is None else torch.maximum(self.value, m)


def smoothing_scales(act_absmax: Tensor, linears: list[nn.Linear], alpha: float) -> Tensor:
    """s [K] = max|X_j|^alpha / max|W_j|^(1 - alpha) over the linears sharing the input."""
    w_absmax = torch.cat([m.weight.abs() for m in linears]).amax(dim=0).float().clamp(min=1e-5)  # [K]
    return (act_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=1e-5)


def _norm_groups(layer: nn.Module) -> list[ScaleGroup]:
    return [g for g in scale_groups(layer) if not isinstance(layer.get_submodule(g.prev), nn.Linear)]


@torch.no_grad()
def activation_absmax(runner: LayerwiseCalibration, layer: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """Per-channel max |input| of the named linears over the runner's inputs to `layer`; the same
    forward gives the next layer's inputs (smoothing leaves the layer's outputs as they are)."""
    meters = {name: _AbsMax() for name in names}
    handles = [layer.get_submodule(name).register_forward_hook(m.hook) for name, m in meters.items()]
    try:
        runner.advance(layer)
    finally:
        for handle in handles:
            handle.remove()
    return {name: m.value for name, m in meters.items() if m.value is not None}


@torch.no_grad()
def smooth_model(model: nn.Module, qconfig: QuantConfig, calibration: Tensor, progress: bool = True) -> None:
    """Fold SmoothQuant's scales (strength qconfig.alpha) into the float model's norms and linears."""
    runner = LayerwiseCalibration(model, calibration, desc="SmoothQuant", progress=progress)
    for _, layer in runner.layers():
        groups = _norm_groups(layer)
        absmax = activation_absmax(runner, layer, [g.linears[0] for g in groups])
        for group in groups:
            if group.linears[0] in absmax:
                linears = [layer.get_submodule(name) for name in group.linears]
                apply_scale(layer, group, smoothing_scales(absmax[group.linears[0]], linears, qconfig.alpha))
    if progress:
        print(runner.report(), file=sys.stderr)
