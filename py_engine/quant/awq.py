"""AWQ (Lin et al., 2023): protect the weights that meet large activations by scaling
them up before rounding, the inverse scale folded into the operation before.

    qweights = awq_quantize(model, qconfig, calibration)  # {"model.layers.0.mlp.up_proj": QuantizedWeight}

Per decoder layer, as llm-awq does it (on the float model: each layer's inputs are the
float layer before it, computed before the layer is changed):
1. One forward of the float layer records the inputs of each scaling group: the norm
   before q/k/v (or Phi-3's qkv_proj), v_proj before o_proj (only when o_proj is as wide
   as v_proj, no grouped-query attention), the norm before gate/up (gate_up_proj), up_proj
   (the up half of gate_up_proj) before down_proj; Mixtral: the norm before router and
   experts, each expert's w3 before its w2.
2. For each group, a grid search over alpha in {0, 0.05, ..., 0.95}: s = mean|x|^alpha
   (normalised by sqrt(max s * min s)), W' = Q(W diag(s)) diag(s)^-1, keeping the s with
   the least mean squared error of the block's output (attention, MLP or the linear
   itself) against the float block. alpha = 0 is plain RTN, so the search never loses to it.
   s is then folded in: W diag(s) in the linears, 1/s into the norm's weight (Gemma's
   (1 + w) norm: 1 + w' = (1 + w) / s) or the previous linear's output rows (and bias).
3. auto-clip: per output row and group, the clipping ratio in {1, 0.95, ..., 0.55} of the
   group's max |w| with the least output error on 512 sampled tokens, for every linear
   but q/k (attention scores amplify their errors); weights are clamped.
4. Group-wise RTN of the scaled, clipped weights (asymmetric by default). Mixtral's router
   is scaled with the experts (it shares their input) but stays float, as transform.py keeps it.

The model is left holding the scaled and clipped float weights (and the folded norms);
the transform swaps its linears for QuantLinear modules built from the returned weights.
The search uses at most `SEARCH_TOKENS` calibration tokens (mean |x| uses all of them).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .calibration import LayerwiseCalibration
from .config import QuantConfig
from .gptq import decoder_linears, is_router
from .groups import fake_quantize, grid_params, quantize_groups, to_codes
from .rtn import QuantizedWeight

__all__ = ["ScaleGroup", "apply_scale", "awq_quantize", "scale_groups", "search_clip", "search_scale"]

GRID = 20  # alpha points of the scale search
CLIP_GRID, MAX_SHRINK, CLIP_TOKENS = 20, 0.5, 512  # llm-awq's auto_clip settings
SEARCH_TOKENS = 4096  # tokens the attention and MLP block searches run on
NO_CLIP = ("q_proj", "k_proj", "gate")  # "gate": Mixtral's router (gate_proj is another name)


@dataclass(frozen=True)
class ScaleGroup:
    """Linears sharing one input, the op that produces it and the block whose output is compared."""

    prev: str  # a norm, or a linear whose output rows `rows` are the input
    linears: tuple[str, ...]  # names inside the layer; the first one's input is recorded
    block: str  # the module whose output the search compares ("" for the linear itself)
    rows: tuple[int, int] | None = None  # rows of a fused previous linear (Phi-3's v or up part)


def scale_groups(layer: nn.Module) -> list[ScaleGroup]:
    """The scaling groups of one decoder layer (llm-awq's and AutoAWQ's choices)."""
    attn = layer.self_attn
    q_dim, kv_dim = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    groups = []
    if attn.fused:
        groups.append(ScaleGroup("input_layernorm", ("self_attn.qkv_proj",), "self_attn"))
        if kv_dim == q_dim:
            groups.append(ScaleGroup("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj",
                                     (q_dim + kv_dim, q_dim + 2 * kv_dim)))
    else:
        groups.append(ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                 "self_attn"))
        if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
            groups.append(ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"))
    norm = "pre_feedforward_layernorm" if layer.sandwich else "post_attention_layernorm"
    if layer.moe:
        moe = layer.block_sparse_moe
        experts = [f"block_sparse_moe.experts.{e}" for e in range(len(moe.experts))]
        groups.append(ScaleGroup(norm, ("block_sparse_moe.gate",) + tuple(f"{x}.{w}" for x in experts
                                                                          for w in ("w1", "w3")),
                                 "block_sparse_moe"))
        groups += [ScaleGroup(f"{x}.w3", (f"{x}.w2",), f"{x}.w2") for x in experts]
    elif layer.mlp.fused:
        i = layer.mlp.down_proj.in_features
        groups.append(ScaleGroup(norm, ("mlp.gate_up_proj",), "mlp"))
        groups.append(ScaleGroup("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", (i, 2 * i)))
    else:
        groups.append(ScaleGroup(norm, ("mlp.gate_proj", "mlp.up_proj"), "mlp"))
        groups.append(ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"))
    return groups


@torch.no_grad()
def apply_scale(layer: nn.Module, group: ScaleGroup, s: Tensor) -> None:
    """Fold s [K] in: the linears' input columns times s, the previous op's output divided by s."""
    s = s.float()
    for name in group.linears:
        w = layer.get_submodule(name).weight
        w.copy_(w.float() * s[None, :])
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, nn.Linear):
        lo, hi = group.rows or (0, prev.out_features)
        prev.weight[lo:hi] = (prev.weight[lo:hi].float() / s[:, None]).to(prev.weight.dtype)
        if prev.bias is not None:
            prev.bias[lo:hi] = (prev.bias[lo:hi].float() / s).to(prev.bias.dtype)
    elif getattr(prev, "unit_offset", False):  # Gemma: x * (1 + w)
        prev.weight.copy_((1.0 + prev.weight.float()) / s - 1.0)
    else:
        prev.weight.copy_(prev.weight.float() / s)


class _Recorder:
    """A forward hook keeping a linear's inputs (up to `limit` rows of sequences), sum |x|
    and, with `gram`, X^T X over every row."""

    def __init__(self, limit: int, gram: bool = False) -> None:
        self.limit, self.kept, self.inputs = limit, 0, []
        self.abs_sum, self.rows, self.gram = None, 0, gram

    def hook(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        x = inputs[0]
        flat = x.reshape(-1, x.shape[-1]).float()  # [rows, K]
        total = flat.abs().sum(0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        if self.gram is not False:
            xtx = flat.T @ flat  # [K, K]
            self.gram = xtx if self.gram is True else self.gram + xtx
        self.rows += flat.shape[0]
        if self.kept < self.limit and flat.shape[0]:
            per_item = flat.shape[0] // x.shape[0]  # T for [b, T, K] inputs, 1 for [rows, K]
            keep = x[: -(-(self.limit - self.kept) // per_item)]
            self.inputs.append(keep)
            self.kept += keep.shape[0] * per_item

    def mean_abs(self) -> Tensor:
        return self.abs_sum / max(self.rows, 1)  # [K]

    def stacked(self) -> Tensor:
        return torch.cat(self.inputs)


@torch.no_grad()
def search_scale(runner: LayerwiseCalibration, layer: nn.Module, group: ScaleGroup, x: Tensor | None,
                 mean_abs: Tensor, qconfig: QuantConfig, gram: Tensor | None = None) -> Tensor:
    """The s [K] of least block output error over the alpha grid (see the module docstring).

    When the block is the group's one linear, its output error comes from the Gram matrix
    X^T X [K, K] of all its calibration inputs instead of a forward over x."""
    block = layer.get_submodule(group.block)
    linears = [layer.get_submodule(name) for name in group.linears if not is_router(name)]  # the router stays float
    originals = [m.weight.detach().clone() for m in linears]
    if gram is None:
        reference = runner.forward(block, x).float()
    best, best_s = float("inf"), torch.ones_like(mean_abs)
    try:
        for point in range(GRID):
            s = mean_abs.pow(point / GRID).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for m, w in zip(linears, originals):
                scaled = w.float() * s[None, :]
                m.weight.copy_(fake_quantize(scaled, qconfig.bits, qconfig.group_size, qconfig.symmetric) / s)
            if gram is not None:  # the block is the linear: mean (x D^T)^2 = sum((D G) * D) / (rows N)
                d = originals[0].float() - linears[0].weight.float()  # [N, K]
                loss = ((d @ gram) * d).sum().item()
            else:
                loss = (runner.forward(block, x).float() - reference).pow(2).mean().item()
            if loss < best:
                best, best_s = loss, s
    finally:
        for m, w in zip(linears, originals):
            m.weight.copy_(w)
    return best_s


@torch.no_grad()
def search_clip(weight: Tensor, x: Tensor, qconfig: QuantConfig) -> Tensor:
    """Per output row and group, the max |w| [N, groups] that quantizes with least output error."""
    n, k = weight.shape
    group = qconfig.group_size or k
    groups = -(-k // group)
    x = x.reshape(-1, k).float()
    x = x[:: max(1, len(x) // CLIP_TOKENS)][:CLIP_TOKENS]
    pad = groups * group - k
    w = torch.nn.functional.pad(weight.float(), (0, pad)).view(n, groups, group)  # [N, G, g]
    x = torch.nn.functional.pad(x, (0, pad)).view(len(x), groups, group)  # [T, G, g]
    reference = torch.einsum("tgk,ngk->ntg", x, w)  # [N, T, G]
    top = w.abs().amax(dim=-1, keepdim=True)  # [N, G, 1]
    best_err = torch.full((n, groups), float("inf"), device=w.device)
    best = top[..., 0].clone()
    for step in range(int(MAX_SHRINK * CLIP_GRID)):
        limit = top * (1 - step / CLIP_GRID)
        clipped = torch.maximum(torch.minimum(w, limit), -limit)
        scale, zero = grid_params(clipped, qconfig.bits, qconfig.symmetric)
        q = (to_codes(clipped, scale, zero, qconfig.bits) - zero) * scale
        err = (torch.einsum("tgk,ngk->ntg", x, q) - reference).pow(2).mean(dim=1)  # [N, G]
        better = err < best_err
        best_err[better], best[better] = err[better], limit[..., 0][better]
    return best


@torch.no_grad()
def _clip(linear: nn.Linear, x: Tensor, qconfig: QuantConfig, rows: tuple[int, int] | None = None) -> None:
    lo, hi = rows or (0, linear.out_features)
    w = linear.weight[lo:hi]
    k, group = w.shape[1], qconfig.group_size or w.shape[1]
    limit = search_clip(w, x, qconfig).repeat_interleave(group, dim=1)[:, :k]  # [N, K]
    linear.weight[lo:hi] = torch.maximum(torch.minimum(w.float(), limit), -limit).to(w.dtype)


@torch.no_grad()
def awq_quantize(model: nn.Module, qconfig: QuantConfig, calibration: Tensor,
                 progress: bool = True) -> dict[str, QuantizedWeight]:
    """AWQ of every decoder linear (not the LM head): {module name: QuantizedWeight}.

    Mutates the float model: folded scales in norms and linears, clipped weights.
    """
    runner = LayerwiseCalibration(model, calibration, desc=f"AWQ {qconfig.bits}-bit", progress=progress)
    out: dict[str, QuantizedWeight] = {}
    for index, layer in runner.layers():
        groups = scale_groups(layer)
        recorders = {"self_attn.o_proj": _Recorder(CLIP_TOKENS)}
        for g in groups:  # linear blocks need only X^T X and a few rows to clip with
            linear_block = g.block == g.linears[0]
            recorders[g.linears[0]] = _Recorder(CLIP_TOKENS if linear_block else SEARCH_TOKENS, linear_block)
        handles = [layer.get_submodule(name).register_forward_hook(r.hook) for name, r in recorders.items()]
        try:
            runner.advance(layer)  # the float layer's outputs feed the next layer
        finally:
            for handle in handles:
                handle.remove()
        inputs: dict[str, Tensor] = {}  # each linear's recorded input, divided by its scales
        for group in groups:
            recorder = recorders[group.linears[0]]
            if recorder.rows == 0:  # an expert no calibration token reached: nothing to measure
                continue
            x = recorder.stacked()
            gram = recorder.gram if isinstance(recorder.gram, Tensor) else None
            s = search_scale(runner, layer, group, x, recorder.mean_abs(), qconfig, gram)
            apply_scale(layer, group, s)
            for name in group.linears:
                inputs[name] = x / s.to(x.dtype)
        if "self_attn.o_proj" not in inputs:  # grouped-query attention: o_proj is not scaled
            inputs["self_attn.o_proj"] = recorders["self_attn.o_proj"].stacked()
        for name, x in inputs.items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "qkv_proj":  # clip the v rows only
                attn = layer.self_attn
                q_dim, kv_dim = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
                _clip(layer.get_submodule(name), x, qconfig, (q_dim + kv_dim, q_dim + 2 * kv_dim))
            elif leaf not in NO_CLIP:
                _clip(layer.get_submodule(name), x, qconfig)
        for name, m in decoder_linears(layer).items():
            out[f"model.layers.{index}.{name}"] = quantize_groups(m.weight, qconfig.bits, qconfig.group_size,
                                                                  qconfig.symmetric)
    if progress:
        print(runner.report(), file=sys.stderr)
    return out

