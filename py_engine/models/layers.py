"""The parts of a decoder block: RMSNorm, Attention, MLP and Mixtral's MoE.

Parameter names are Hugging Face's, so a checkpoint's state dict loads as
is. Family differences come from `ModelConfig` flags: Gemma's `(1 + w)` norm,
biases, Qwen3's per-head q/k norm, Phi-3's fused `qkv_proj`/`gate_up_proj`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from .attention import AttentionSpec
from .kv_cache import KVCache
from .rope import apply_rotary

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in float32; Gemma scales by (1 + w) instead of w."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma multiplies in float32, then casts
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)  # Llama casts, then multiplies


class MLP(nn.Module):
    """Gated feed-forward down(act(gate(x)) * up(x)): SwiGLU, or GeGLU for Gemma."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.fused = config.fused_projections
        if self.fused:  # Phi-3 stores gate and up as one [2 * i, h] matrix, gate first
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=bias)
        else:
            self.gate_proj = nn.Linear(h, i, bias=bias)
            self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class Expert(nn.Module):
    """One Mixtral expert: w2(act(w1(x)) * w3(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(h, i, bias=False)  # gate
        self.w2 = nn.Linear(i, h, bias=False)  # down
        self.w3 = nn.Linear(h, i, bias=False)  # up
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Mixtral's block: each token goes to its top-k experts, weighted by the
    router's softmax renormalised over those k (as transformers does)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config) for _ in range(config.num_local_experts))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, hidden]
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [N, experts]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)  # the tokens routed to expert e
            if token.numel():
                y = expert(x[token]) * weights[token, slot, None]  # [n, hidden], float32
                out.index_add_(0, token, y.to(x.dtype))
        return out.view(shape)


class Attention(nn.Module):
    """Grouped-query self-attention with rope; the KV cache does write + attend."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        h, q_dim, kv_dim = config.hidden_size, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.fused = config.fused_projections
        if self.fused:  # Phi-3: one [q_dim + 2 * kv_dim, h] matrix, q then k then v
            self.qkv_proj = nn.Linear(h, q_dim + 2 * kv_dim, bias=config.attention_bias)
        else:
            self.q_proj = nn.Linear(h, q_dim, bias=config.attention_bias)
            self.k_proj = nn.Linear(h, kv_dim, bias=config.attention_bias)
            self.v_proj = nn.Linear(h, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=config.o_proj_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's channels, before rope
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.spec = AttentionSpec(
            scale=config.attention_scale,
            sliding_window=config.sliding_window if config.is_sliding(layer) else None,
            softcap=config.attn_logit_softcapping)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.fused:
            q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            return self.qkv_proj(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, kv: KVCache) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self._project(x)
        q = q.view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, KV, D]
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, KV, T, D]
        out = kv.attend(self.layer, q, k, v, positions, self.spec)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # [B, T, H * D] -> [B, T, hidden]
