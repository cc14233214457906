"""The model's RMSNorm, Attention and MLP with their small decode-time ops in C (py_engine.kernels).

`use_cpu_layers(model, kernels)` (transforms.py) gives each such module a subclass whose
forward takes the kernels' path where it applies and is otherwise the
model's own (`super().forward`), so the torch code stays the reference:
- KernelRMSNorm: inputs of the weight's dtype (fp32 or bf16);
- KernelAttention: one token of one sequence over a DenseKVCache of the
  activations' dtype, fused qkv, no qk_norm: rope, the cache write and the
  attention are one call (rk_attend_one) instead of ~35 torch ops;
- KernelMLP: one token through a SiLU gate: gate, up, SiLU and product in
  one call (rk_linear_gated);
- KernelDecoderModel (stack.py): once these modules have their plans, a
  whole decode step of one sequence as one call (rk_decode_step).
Only the class changes: parameters, names and the tied head stay as they are.
Why: a decode step of Qwen2.5-0.5B dispatched ~1,800 torch ops, ~15 ms of
CPU per token, half of what streaming its bf16 weights takes at 30 GB/s.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import ColdTier, CpuKernels
from ..models.kv_cache import DenseKVCache, KVCache, TwoTierDenseKVCache
from ..models.layers import MLP, Attention, RMSNorm
from .linears import FusedLinear, KernelLinear

DTYPES = (torch.float32, torch.bfloat16)


def _grad(x: Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class KernelRMSNorm(RMSNorm):
    kernels: CpuKernels

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in DTYPES and x.dtype == self.weight.dtype and x.device.type == "cpu" and not _grad(x):
            return self.kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return super().forward(x)


class KernelAttention(Attention):
    kernels: CpuKernels

    def _fast(self, x: Tensor, kv: KVCache, positions: Tensor) -> bool:
        """One sequence over a DenseKVCache of x's dtype on the CPU (rows: a decode token, a prompt chunk or a
        speculative step). A two-tier cache's chunks take it while no query of theirs reads a block cold, and
        keep the torch path (cold blocks read from the dequantized buffers) after."""
        if not (isinstance(kv, DenseKVCache) and x.shape[0] == 1 and self.fused and not self.qk_norm):
            return False
        if x.shape[1] > 1 and isinstance(kv, TwoTierDenseKVCache) and (
                kv.settled or kv.quant.cold_edge(int(positions[0, -1])) > 0):
            return False
        keys = kv.keys[self.layer]
        return (x.dtype in DTYPES and keys.dtype == x.dtype and keys.device.type == "cpu" and keys.shape[0] == 1
                and keys.is_contiguous() and kv.values[self.layer].is_contiguous()
                and self.head_dim % 8 == 0 and not _grad(x))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, kv: KVCache) -> Tensor:
        if not self._fast(x, kv, positions):
            return super().forward(x, cos, sin, positions, kv)
        assert isinstance(kv, DenseKVCache)
        rows = x.shape[1]
        position = int(positions[0, 0])  # [1, T]: position..position + T - 1 (the backends' calls)
        keys, values = kv.keys[self.layer], kv.values[self.layer]  # [1, KV, max_len, D]
        if position + rows > keys.shape[2]:
            raise ValueError(f"position {position + rows - 1} does not fit a cache of max_len {keys.shape[2]}")
        window = self.spec.sliding_window
        qkv = self.qkv_proj(x)  # [1, T, (H + 2 KV) * D]
        if rows > 1:  # a chunk: each row as decode computes it (rk_attend_rows), never torch's SDPA
            if int(positions[0, -1]) != position + rows - 1:
                return super().forward(x, cos, sin, positions, kv)
            out = self.kernels.attend_rows(qkv[0], cos[0].contiguous(), sin[0].contiguous(), keys, values,
                                           self.n_heads, position, window, self.spec.scale, self.spec.softcap)
            return self.o_proj(out.view(1, rows, -1))  # [1, T, hidden]
        cold = None
        if isinstance(kv, TwoTierDenseKVCache):
            if self.layer == 0:
                kv.settle(position)  # attend() would have: blocks leaving the hot window turn cold first
            cold = ColdTier.of(kv.codes[self.layer], kv.settled, kv.quant.bits) if kv.settled else None
        start = 0 if window is None else max(0, position + 1 - window)
        out = self.kernels.attend_one(qkv, cos.contiguous(), sin.contiguous(), keys, values, self.n_heads,
                                      position, start, self.spec.scale, self.spec.softcap, cold)  # [H * D]
        return self.o_proj(out.view(1, 1, -1))  # [1, 1, hidden]


class KernelMLP(MLP):
    kernels: CpuKernels

    def _gate_up(self, proj: nn.Module | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None:
        """Gate and up weights and biases as separate [I, H] tensors, when the layout allows (proj: the
        gate_up_proj to read, by default the module's own; a LoRA-wrapped one gives None: torch adds the delta)."""
        proj = getattr(self, "gate_up_proj", None) if proj is None else proj
        parts = proj.parts if isinstance(proj, FusedLinear) else []
        if len(parts) == 2 and all(isinstance(p, nn.Linear) for p in parts):  # not quantized ones
            gate, up = parts
            return gate.weight, up.weight, gate.bias, up.bias
        if isinstance(proj, KernelLinear):  # Phi-3's stored [2 I, H]: gate rows, then up rows
            w_gate, w_up = proj.weight.chunk(2)
            b_gate, b_up = proj.bias.chunk(2) if proj.bias is not None else (None, None)
            return w_gate, w_up, b_gate, b_up
        return None

    def forward(self, x: Tensor) -> Tensor:
        proj = self._modules.get("gate_up_proj")
        if self.act is F.silu and type(proj) is FusedLinear and not isinstance(proj.parts[0], nn.Linear):
            hidden = _gated_forward()(proj, x)  # quantized gate and up: one call, the SiLU in C
            if hidden is not None:
                return self.down_proj(hidden)
        silu = self.act is F.silu and not _grad(x)
        parts = self._gate_up() if silu and x.numel() == x.shape[-1] else None
        if parts is None or not all(self.kernels.supports(x, w) for w in parts[:2]):
            if silu and type(proj) is FusedLinear and x.numel() > x.shape[-1] and self._gate_up() is not None \
                    and x.dtype in DTYPES:  # prefill: the product on the kernels, then the gate on their pool
                return self.down_proj(self.kernels.silu_gate(proj(x)))
            return super().forward(x)
        return self.down_proj(self.kernels.linear_gated(x, *parts))


def _gated_forward():
    from ..quant.linear import gated_forward  # quant imports models: not at import time

    return gated_forward
