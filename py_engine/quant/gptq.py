"""GPTQ (Frantar et al., 2022): quantize a linear's columns one at a time, each time
moving the rounding error onto the columns not yet quantized, weighted by the inverse
Hessian of the layer's squared output error.

    qweights = gptq_quantize(model, qconfig, calibration)  # {"model.layers.0.self_attn.q_proj": QuantizedWeight}

Per linear, H = 2 X^T X / n over its n calibration input rows X [n, K]. `gptq_weight` is
the paper's Algorithm 1: dampen H (damp_percent of its mean diagonal; a column whose input
is always zero is dropped), take the upper Cholesky factor U of H^-1, then for each block
of 128 columns update column by column inside the block (err = (w - q) / U_jj,
W[:, j:] -= err U_j,j:) and the columns after it lazily, once per block.

Choices where the paper and the reference code leave room:
- Groups are contiguous along K in the original column order, as `QuantizedWeight` (and the
  ONNX and HF checkpoint layouts without g_idx) need. A group's grid is computed when its
  first column comes up, from that moment's fully updated weights (the in-block updates
  included; the reference code reads the stale global copy inside a block).
- act_order quantizes columns by decreasing H diagonal; with groups this is "static groups
  computed lazily": each original-order group still gets one grid, taken when the first of
  its columns is reached in act order.
- Layers are quantized in sequence and, inside a layer, in AutoGPTQ's "true sequential"
  stages (q/k/v, then o, then gate/up, then down): each stage's Hessians come from inputs
  computed by the stages and layers already quantized.
- Linears fed the same input (q/k/v, gate/up) share one Hessian; GPTQ treats output rows
  independently, so their weights are stacked and quantized in one pass. Each stage's forward
  stops as soon as its linears have seen their inputs.
- The grids are `groups.py`'s (onnxruntime's arithmetic: symmetric puts the group's extreme
  value on a code, asymmetric stretches the range to hold 0), not the reference's.
- The float model is left holding the dequantized weights of every quantized linear (the
  transform then swaps in QuantLinear modules built from the returned QuantizedWeights).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor, nn

from .calibration import LayerwiseCalibration
from .config import QuantConfig
from .groups import from_grid, grid_params, quantize_groups, reciprocal, to_codes
from .rtn import QuantizedWeight

__all__ = ["Hessian", "StageHessians", "decoder_linears", "is_router", "split_rows", "gptq_quantize", "gptq_weight", "stage_of"]

BLOCK = 128  # columns updated lazily together (the paper's B)


def is_router(name: str) -> bool:
    """Mixtral's router: it stays float (transform.block_linears leaves it out too)."""
    return name.endswith("block_sparse_moe.gate")


def decoder_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The nn.Linears of a decoder layer to quantize, by their names inside the layer (not the router)."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear) and not is_router(name)}


def stage_of(name: str) -> int:
    """Which of a layer's sequential stages quantizes this linear: 0 attention inputs, 1 its
    output, 2 feed-forward inputs (Mixtral's experts' w1/w3 too), 3 its output."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
        return 0
    if leaf == "o_proj":
        return 1
    if leaf in ("down_proj", "w2"):
        return 3
    return 2


class Hessian:
    """Running 2 X^T X / n of one linear's inputs."""

    def __init__(self, linear: nn.Linear) -> None:
        k = linear.in_features
        self.sum = torch.zeros(k, k, dtype=torch.float32, device=linear.weight.device)
        self.rows = 0

    def add(self, xtx: Tensor, rows: int) -> None:
        self.sum += xtx
        self.rows += rows

    def matrix(self) -> Tensor:
        return self.sum * (2.0 / max(self.rows, 1))


class _StageDone(Exception):
    """Raised by a hook once every linear of the stage has seen the chunk: the rest of the layer is not needed."""


class StageHessians:
    """Forward hooks giving the Hessians of one stage's linears.

    Linears fed the same tensor (q/k/v, gate/up) share one Hessian (`owner` maps each
    linear to the first one of its input), and the layer's forward stops (_StageDone) as
    soon as each linear of the stage has seen the chunk.
    """

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        self.linears = linears
        self.hessians: dict[str, Hessian] = {}  # owner name -> Hessian
        self.owner: dict[str, str] = {}
        self.seen: set[str] = set()
        self.last: tuple[Tensor | None, str] = (None, "")  # (input, owner of it) in this chunk

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            x = inputs[0]
            if name not in self.owner:
                self.owner[name] = self.last[1] if self.last[0] is x else name
            owner = self.owner[name]
            if owner == name:
                rows = x.numel() // x.shape[-1]
                flat = x.reshape(rows, x.shape[-1]).float()  # [rows, K]
                self.hessians.setdefault(name, Hessian(self.linears[name])).add(flat.T @ flat, rows)
            self.last = (x, owner)
            self.seen.add(name)
            if len(self.seen) == len(self.linears):
                raise _StageDone
        return hook

    @torch.no_grad()
    def collect(self, runner: LayerwiseCalibration, layer: nn.Module) -> dict[str, list[str]]:
        """Run the chunks through the layer; {owner: the linears sharing its Hessian}."""
        handles = [m.register_forward_hook(self._hook(name)) for name, m in self.linears.items()]
        try:
            for x in runner.chunks():
                self.seen.clear()
                try:
                    runner.call(layer, x)
                except _StageDone:
                    pass
        finally:
            for handle in handles:
                handle.remove()
            self.last = (None, "")
        shared: dict[str, list[str]] = {}
        for name in self.linears:
            shared.setdefault(self.owner.get(name, name), []).append(name)
        return shared


def split_rows(qw: QuantizedWeight, sizes: list[int]) -> list[QuantizedWeight]:
    """The QuantizedWeights of linears whose weights were stacked along the output dimension."""
    parts = zip(qw.codes.split(sizes), qw.scales.split(sizes), qw.zero_points.split(sizes))
    return [replace(qw, codes=c.contiguous(), scales=s.contiguous(), zero_points=z.contiguous()) for c, s, z in parts]


def _inverse_cholesky(h: Tensor, damp_percent: float) -> Tensor:
    """Upper U with (H + damp I)^-1 = U^T U; more damping if H is not positive definite."""
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    damp = damp_percent * h.diagonal().mean()
    for _ in range(5):
        lower, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
        damp = damp * 10 if damp > 0 else 1e-6 * h.diagonal().abs().mean() + 1e-12
    raise ValueError("GPTQ: the Hessian is not positive definite even with damping; more calibration data?")


@contextmanager
def _one_thread():
    """The column loop is thousands of tiny ops: with two threads whose OpenMP workers spin
    (the default wait policy) on a busy two-core machine it ran 60x slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def gptq_weight(weight: Tensor, hessian: Tensor, bits: int = 4, group_size: int | None = 128,
                symmetric: bool = True, damp_percent: float = 0.01, act_order: bool = False,
                block_size: int = BLOCK) -> QuantizedWeight:
    """GPTQ of W [N, K] given H [K, K]; computes in float64 when H is float64, else float32."""
    with _one_thread():
        return _gptq(weight, hessian, bits, group_size, symmetric, damp_percent, act_order, block_size)


def _gptq(weight: Tensor, hessian: Tensor, bits: int, group_size: int | None, symmetric: bool,
          damp_percent: float, act_order: bool, block_size: int) -> QuantizedWeight:
    dtype = torch.float64 if hessian.dtype == torch.float64 else torch.float32
    w = weight.detach().to(dtype).clone()  # [N, K]
    h = hessian.detach().to(device=w.device, dtype=dtype).clone()  # [K, K]
    n, k = w.shape
    group = group_size or k
    dead = h.diagonal() == 0  # inputs that are always zero: any weight will do, take 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = (torch.argsort(h.diagonal(), descending=True, stable=True) if act_order
            else torch.arange(k, device=w.device))
    inv = torch.argsort(perm)
    w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_cholesky(h, damp_percent)  # [K, K] upper
    groups = -(-k // group)
    scale = w.new_zeros(n, groups)
    zero = w.new_zeros(n, groups)
    inverse = w.new_zeros(n, groups)  # 1 / scale
    ready = [False] * groups
    group_of = (perm // group).tolist()  # group of the column at each processing position
    codes = torch.zeros_like(w)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()  # [N, B]: this block, updated column by column
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = group_of[i1 + i]
            if not ready[g]:
                pos = inv[g * group: min((g + 1) * group, k)]  # where the group's columns are processed
                current = _current(w, w1, err1, u, pos, i1, i2, i)  # [N, group]
                s, z = grid_params(current, bits, symmetric)
                scale[:, g], zero[:, g], ready[g] = s[:, 0], z[:, 0], True
                inverse[:, g] = reciprocal(s[:, 0])
            col, s, z = w1[:, i], scale[:, g], zero[:, g]
            q = to_codes(col, s, z, bits, inverse[:, g])
            codes[:, i1 + i] = q
            e = (col - (q - z) * s) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    return from_grid(codes[:, inv], scale, zero, bits, group, symmetric, k)


def _current(w: Tensor, w1: Tensor, err1: Tensor, u: Tensor, pos: Tensor, i1: int, i2: int, i: int) -> Tensor:
    """Fully updated values [N, len(pos)] of not-yet-quantized processing positions pos:
    in the block from w1; after it, w less the block's pending updates of columns before i."""
    out = w.new_empty(w.shape[0], len(pos))
    inside = pos < i2
    if inside.any():
        out[:, inside] = w1[:, pos[inside] - i1]
    if (~inside).any():
        later = pos[~inside]
        out[:, ~inside] = w[:, later] - err1[:, :i] @ u[i1: i1 + i, later]
    return out


@torch.no_grad()
def gptq_quantize(model: nn.Module, qconfig: QuantConfig, calibration: Tensor,
                  progress: bool = True) -> dict[str, QuantizedWeight]:
    """GPTQ of every decoder linear (not the LM head), layer by layer and stage by stage.

    Returns {module name as in model.named_modules(): QuantizedWeight}; the model's linears
    are left holding their dequantized weights.
    """
    runner = LayerwiseCalibration(model, calibration, desc=f"GPTQ {qconfig.bits}-bit", progress=progress)
    out: dict[str, QuantizedWeight] = {}
    for index, layer in runner.layers():
        linears = decoder_linears(layer)
        for stage in sorted({stage_of(name) for name in linears}):
            names = [name for name in linears if stage_of(name) == stage]
            stage_hessians = StageHessians({name: linears[name] for name in names})
            for owner, sharing in stage_hessians.collect(runner, layer).items():
                # linears with one input share H: GPTQ treats rows independently, so stack them
                weights = [linears[name].weight for name in sharing]
                hessian = stage_hessians.hessians.get(owner)
                stacked = torch.cat(weights) if len(weights) > 1 else weights[0]
                if hessian is None or hessian.rows == 0:  # an expert no calibration token reached: RTN
                    qw = quantize_groups(stacked, qconfig.bits, qconfig.group_size, qconfig.symmetric)
                else:
                    qw = gptq_weight(stacked, hessian.matrix(), qconfig.bits, qconfig.group_size,
                                     qconfig.symmetric, qconfig.damp_percent, qconfig.act_order)
                for name, part in zip(sharing, split_rows(qw, [w.shape[0] for w in weights])):
                    linears[name].weight.copy_(part.dequantize().to(linears[name].weight))
                    out[f"model.layers.{index}.{name}"] = part
    if progress:
        print(runner.report(), file=sys.stderr)
    return out
