"""Norms, feed-forward blocks and the attention sublayer of one decoder block, as nodes.

Each function mirrors a module of py_engine.models.layers, reading its
parameters by their Hugging Face names. Fusions are applied here, on the
graph, never in the torch model: q/k/v become one projection (GQA takes the
packed result), gate and up one projection, and the residual add joins the
next norm (SkipSimplifiedLayerNormalization) in the contrib-op variants.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto
from torch import nn

from py_engine.config import ModelConfig
from py_engine.models.layers import MLP, Attention, RMSNorm, SparseMoE

from .attention import AttentionInputs, group_query_attention, plain_attention
from .graph import MS_DOMAIN, GraphBuilder
from .linear import Linear
from .options import ExportOptions
from .quantized import concat, layer_weight


@dataclass
class BlockEmitter:
    """Shared state for emitting one graph's blocks."""

    g: GraphBuilder
    config: ModelConfig
    options: ExportOptions
    linear: Linear

    def norm_weight(self, norm: RMSNorm, name: str, dtype: type | None = None) -> str:
        w = norm.weight.detach().float()
        if norm.unit_offset:  # Gemma scales by (1 + w), in float32 like the torch model
            w = 1.0 + w
        init = self.g.initializer(f"{name}.weight", w.numpy().astype(dtype or self.linear.float_dtype))
        self.g.records[name] = {"norm": init, "eps": float(norm.eps), "unit_offset": bool(norm.unit_offset)}
        return init

    def rms_norm(self, x: str, norm: RMSNorm, name: str) -> str:
        g = self.g
        if self.options.contrib_ops:  # stash_type 1: float32 inside, whatever the activations' type
            return g.node("SimplifiedLayerNormalization", [x, self.norm_weight(norm, name)],
                          f"{name}/SimplifiedLayerNorm", axis=-1, epsilon=float(norm.eps), stash_type=1)
        half = self.linear.float_dtype == np.float16
        if half:  # x * x overflows float16 for activations past 256: normalise in float32
            x = g.node("Cast", [x], f"{name}/to_float", to=TensorProto.FLOAT)
        mean = g.node("ReduceMean", [g.node("Mul", [x, x], f"{name}/square"), g.const([-1])], f"{name}/mean",
                      keepdims=1)
        rms = g.node("Sqrt", [g.node("Add", [mean, g.const(norm.eps, np.float32)], f"{name}/eps")], f"{name}/sqrt")
        out = g.node("Mul", [g.node("Div", [x, rms], f"{name}/normalize"), self.norm_weight(norm, name, np.float32)],
                     f"{name}/weight")
        return g.node("Cast", [out], f"{name}/to_half", to=TensorProto.FLOAT16) if half else out

    def add_norm(self, x: str, delta: str | None, norm: RMSNorm, name: str) -> tuple[str, str]:
        """(norm(x + delta), x + delta); delta None normalizes x alone."""
        if delta is None:
            return self.rms_norm(x, norm, name), x
        if self.options.contrib_ops:
            w = self.norm_weight(norm, name)
            out = self.g.node("SkipSimplifiedLayerNormalization", [delta, x, w], f"{name}/SkipSimplifiedLayerNorm",
                              outputs=4, domain=MS_DOMAIN, epsilon=float(norm.eps))
            return out[0], out[3]
        total = self.g.node("Add", [x, delta], f"{name}/residual")
        return self.rms_norm(total, norm, name), total

    def act(self, x: str, name: str) -> str:
        g, kind = self.g, self.config.hidden_act
        if kind in ("silu", "swish"):
            if self.options.contrib_ops:
                return g.node("QuickGelu", [x], f"{name}/silu", domain=MS_DOMAIN, alpha=1.0)
            return g.node("Mul", [x, g.node("Sigmoid", [x], f"{name}/sigmoid")], f"{name}/silu")
        if kind == "relu":
            return g.node("Relu", [x], f"{name}/relu")
        approximate = "none" if kind == "gelu" else "tanh"
        if self.options.contrib_ops and approximate == "tanh":
            return g.node("FastGelu", [x], f"{name}/gelu_tanh", domain=MS_DOMAIN)
        return g.node("Gelu", [x], f"{name}/gelu", approximate=approximate)

    def gated(self, x: str, gate_up, bias: torch.Tensor | None, down: nn.Module, name: str) -> str:
        """down(act(gate) * up) with gate and up as one [2I, h] projection (float or quantized), gate first."""
        both = self.linear(x, gate_up, bias, f"{name}/gate_up_proj")  # [B, T, 2I]
        gate, up = self.g.node("Split", [both], f"{name}/split", outputs=2, axis=-1, num_outputs=2)
        hidden = self.g.node("Mul", [self.act(gate, name), up], f"{name}/gated")
        return self.linear(hidden, layer_weight(down), down.bias, f"{name}/down_proj")

    def mlp(self, x: str, mlp: MLP, name: str) -> str:
        if mlp.fused:
            return self.gated(x, layer_weight(mlp.gate_up_proj), mlp.gate_up_proj.bias, mlp.down_proj, name)
        bias = None
        if mlp.gate_proj.bias is not None:
            bias = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
        weight = concat([layer_weight(mlp.gate_proj), layer_weight(mlp.up_proj)], f"{name}/gate_up_proj")  # [2I, h]
        return self.gated(x, weight, bias, mlp.down_proj, name)

    def moe(self, x: str, moe: SparseMoE, name: str) -> str:
        """Mixtral: every expert runs densely, weighted by the top-k renormalised router probabilities
        (zero for the others), which equals routing. Simple and exact; a routed kernel is future work."""
        g = self.g
        logits = self.linear(x, layer_weight(moe.gate), None, f"{name}/router", quantize=False)  # [B, T, E]
        probs = g.node("Softmax", [logits], f"{name}/router_softmax", axis=-1)
        top, chosen = g.node("TopK", [probs, g.const([moe.top_k])], f"{name}/topk", outputs=2, axis=-1)
        top = g.node("Div", [top, g.node("ReduceSum", [top, g.const([-1])], f"{name}/topk_sum", keepdims=1)],
                     f"{name}/renormalise")
        zeros = g.node("Mul", [probs, g.const(0.0, self.linear.float_dtype)], f"{name}/zeros")
        weights = g.node("ScatterElements", [zeros, chosen, top], f"{name}/weights", axis=-1)  # [B, T, E]
        out = None
        for e, expert in enumerate(moe.experts):
            w = g.node("Slice", [weights, g.const([e]), g.const([e + 1]), g.const([-1])], f"{name}/w{e}")
            w13 = concat([layer_weight(expert.w1), layer_weight(expert.w3)], f"{name}/expert{e}")
            y = self.gated(x, w13, None, expert.w2, f"{name}/expert{e}")
            y = g.node("Mul", [y, w], f"{name}/weighted{e}")
            out = y if out is None else g.node("Add", [out, y], f"{name}/sum{e}")
        return out

    def attention(self, x: str, attn: Attention, layer: int, past: tuple[str, str], shared: AttentionInputs,
                  name: str) -> tuple[str, str, str]:
        weight, bias = _qkv_weight(attn, name)
        qkv = self.linear(x, weight, bias, f"{name}/qkv_proj")  # [B, T, (H+2KV)D]
        h, kv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        if self.options.contrib_ops and not attn.qk_norm and shared.rope_in_kernel:
            out, pk, pv = group_query_attention(self.g, self.config, layer, qkv, None, None, past, shared, name)
        else:
            q, k, v = self.g.node("Split", [qkv, self.g.const([h * d, kv * d, kv * d])], f"{name}/split_qkv",
                                  outputs=3, axis=-1)
            if attn.qk_norm:  # Qwen3: RMSNorm over each head's channels, before rope
                q = self.head_norm(q, attn.q_norm, h, d, f"{name}/q_norm")
                k = self.head_norm(k, attn.k_norm, kv, d, f"{name}/k_norm")
            fn = group_query_attention if self.options.contrib_ops else plain_attention
            out, pk, pv = fn(self.g, self.config, layer, q, k, v, past, shared, name)
        return self.linear(out, layer_weight(attn.o_proj), attn.o_proj.bias, f"{name}/o_proj"), pk, pv

    def head_norm(self, x: str, norm: RMSNorm, heads: int, d: int, name: str) -> str:
        """RMSNorm over each head: [B, T, heads*D] -> [B, T, heads, D] -> norm -> back."""
        g = self.g
        x = g.node("Reshape", [x, g.const([0, 0, heads, d])], f"{name}/heads")
        x = self.rms_norm(x, norm, name)
        return g.node("Reshape", [x, g.const([0, 0, heads * d])], f"{name}/flat")


def _qkv_weight(attn: Attention, name: str):
    """(weight [(H+2KV)D, h], bias or None) of q, k and v stacked: Phi-3's fused qkv_proj as it is."""
    if attn.fused:
        return layer_weight(attn.qkv_proj), attn.qkv_proj.bias
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    return concat([layer_weight(p) for p in parts], f"{name}/qkv_proj"), bias
