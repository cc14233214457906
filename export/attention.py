"""Self-attention with a KV cache as graph nodes: fused GroupQueryAttention or plain ONNX.

Both variants take q [B, T, H*D], k and v [B, T, KV*D] from the projections
and the layer's past k/v [B, KV, P, D]; they return the attention output
[B, T, H*D] and the present k/v [B, KV, P+T, D] (past then new, slot-aligned
with attention_mask).

- GroupQueryAttention (onnxruntime contrib op) rotates q and k itself from
  the cos/sin tables (do_rotary), concatenates the cache, and applies the
  causal, sliding-window and softcap rules in one kernel. It derives rope
  positions from the attention mask (slot = position), which is what every
  ruvllm caller passes; position_ids then only matter to the plain variant.
  Its local_window_size is the window as transformers counts it (W tokens,
  the query's own included), checked by the sliding-window parity tests.
- plain: Gather cos/sin by position_ids, rotate, Concat the cache, and
  attend with grouped heads by folding the group into the query rows
  ([B, KV, G*T, D] @ [B, KV, D, S]) instead of repeating k and v.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from py_engine.config import ModelConfig

from .graph import MS_DOMAIN, GraphBuilder



@dataclass(frozen=True)
class AttentionInputs:
    """Per-call tensors every layer shares, computed once at the top of the graph."""

    cos: str  # GQA: [max_pos, rot/2] table; plain: [B, 1, T, rot] for this call's positions
    sin: str
    seqlens_k: str | None = None  # GQA: int32 [B], valid tokens - 1
    total_len: str | None = None  # GQA: int32 scalar, attention_mask's width
    masks: dict[int | None, str] | None = None  # plain: bool [B, 1, G*T, S] per sliding window (None: full)
    rot_dim: int = 0  # rotated channels of each head
    rope_in_kernel: bool = True  # GQA rotates q and k itself; else cos/sin are per position, as in plain
    float_dtype: type = np.float32  # activations (float16 for fp16 exports)


def group_query_attention(g: GraphBuilder, config: ModelConfig, layer: int, q: str, k: str | None,
                          v: str | None, past: tuple[str, str], shared: AttentionInputs,
                          name: str) -> tuple[str, str, str]:
    """Fused attention; q may hold q, k and v packed ([B, T, (H + 2KV) * D]) with k, v None."""
    if not shared.rope_in_kernel:  # rotate here: [B, T, n*D] -> [B, n, T, D] -> rope -> back
        q = _rope_flat(g, q, config.num_attention_heads, config.head_dim, shared, f"{name}/q_rope")
        k = _rope_flat(g, k, config.num_key_value_heads, config.head_dim, shared, f"{name}/k_rope")
    window = config.sliding_window if config.is_sliding(layer) else None
    inputs = [q, k or "", v or "", past[0], past[1], shared.seqlens_k, shared.total_len]
    if shared.rope_in_kernel:
        inputs += [shared.cos, shared.sin]
    return g.node("GroupQueryAttention", inputs, f"{name}/GroupQueryAttention", outputs=3, domain=MS_DOMAIN,
                  num_heads=config.num_attention_heads, kv_num_heads=config.num_key_value_heads,
                  scale=float(config.attention_scale), local_window_size=window if window else -1,
                  softcap=float(config.attn_logit_softcapping or 0.0), do_rotary=int(shared.rope_in_kernel),
                  rotary_interleaved=0)


def plain_attention(g: GraphBuilder, config: ModelConfig, layer: int, q: str, k: str, v: str,
                    past: tuple[str, str], shared: AttentionInputs, name: str) -> tuple[str, str, str]:
    """Standard-ops attention: rope, cache concat, grouped scores, mask, softmax.

    Masked scores become the dtype's lowest finite value, so an all-masked row cannot make NaN."""
    h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = _heads(g, q, h, d, f"{name}/q")  # [B, H, T, D]
    k = _heads(g, k, kv, d, f"{name}/k")  # [B, KV, T, D]
    v = _heads(g, v, kv, d, f"{name}/v")  # [B, KV, T, D]
    q, k = rotate(g, q, shared, d, f"{name}/q_rope"), rotate(g, k, shared, d, f"{name}/k_rope")
    present_k = g.node("Concat", [past[0], k], f"{name}/present_k", axis=2)  # [B, KV, S, D]
    present_v = g.node("Concat", [past[1], v], f"{name}/present_v", axis=2)
    # head h reads kv head h // G, so [B, H, T, D] -> [B, KV, G*T, D] groups rows (g, t)
    q = g.node("Reshape", [q, g.const([0, kv, -1, d])], f"{name}/q_groups")
    kt = g.node("Transpose", [present_k], f"{name}/kT", perm=[0, 1, 3, 2])  # [B, KV, D, S]
    scores = g.node("MatMul", [q, kt], f"{name}/scores")  # [B, KV, G*T, S]
    dtype = shared.float_dtype
    scores = g.node("Mul", [scores, g.const(config.attention_scale, dtype)], f"{name}/scale")
    cap = config.attn_logit_softcapping
    if cap:
        c = g.const(cap, dtype)
        scores = g.node("Mul", [g.node("Tanh", [g.node("Div", [scores, c], f"{name}/cap_div")], f"{name}/cap_tanh"),
                                c], f"{name}/cap_mul")
    window = config.sliding_window if config.is_sliding(layer) else None
    scores = g.node("Where", [shared.masks[window], scores, g.const(np.finfo(dtype).min, dtype)], f"{name}/mask")
    probs = g.node("Softmax", [scores], f"{name}/softmax", axis=-1)  # [B, KV, G*T, S]
    out = g.node("MatMul", [probs, present_v], f"{name}/context")  # [B, KV, G*T, D]
    out = g.node("Reshape", [out, g.const([0, h, -1, d])], f"{name}/context_heads")  # [B, H, T, D]
    out = g.node("Transpose", [out], f"{name}/context_T", perm=[0, 2, 1, 3])  # [B, T, H, D]
    out = g.node("Reshape", [out, g.const([0, 0, h * d])], f"{name}/context_flat")  # [B, T, H*D]
    return out, present_k, present_v


def _rope_flat(g: GraphBuilder, x: str, heads: int, d: int, shared: AttentionInputs, name: str) -> str:
    x = rotate(g, _heads(g, x, heads, d, name), shared, d, name)  # [B, heads, T, D]
    x = g.node("Transpose", [x], f"{name}/seq_first", perm=[0, 2, 1, 3])  # [B, T, heads, D]
    return g.node("Reshape", [x, g.const([0, 0, heads * d])], f"{name}/flat")


def _heads(g: GraphBuilder, x: str, heads: int, d: int, name: str) -> str:
    """[B, T, heads*D] -> [B, heads, T, D]."""
    x = g.node("Reshape", [x, g.const([0, 0, heads, d])], f"{name}/split_heads")  # [B, T, heads, D]
    return g.node("Transpose", [x], f"{name}/heads_first", perm=[0, 2, 1, 3])


def rotate(g: GraphBuilder, x: str, shared: AttentionInputs, d: int, name: str) -> str:
    """x * cos + rotate_half(x) * sin on the first rot channels of x [B, heads, T, D]."""
    rot = shared.rot_dim
    if rot < d:
        x_rot, x_pass = g.node("Split", [x, g.const([rot, d - rot])], f"{name}/split_pass", outputs=2, axis=-1)
    else:
        x_rot, x_pass = x, None
    x1, x2 = g.node("Split", [x_rot, g.const([rot // 2, rot // 2])], f"{name}/halves", outputs=2, axis=-1)
    rotated = g.node("Concat", [g.node("Neg", [x2], f"{name}/neg"), x1], f"{name}/rotate_half", axis=-1)
    out = g.node("Add", [g.node("Mul", [x_rot, shared.cos], f"{name}/cos"),
                         g.node("Mul", [rotated, shared.sin], f"{name}/sin")], f"{name}/sum")
    if x_pass is not None:
        out = g.node("Concat", [out, x_pass], f"{name}/join_pass", axis=-1)
    return out
