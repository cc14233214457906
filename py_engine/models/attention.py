"""The attention kernel: scores of rotated queries against cached keys.

This is the plain-torch reference that KV caches call after writing the new
keys and values. Masks are built from positions, not from call shapes: a
query at position p sees keys at positions k with k <= p, and, in a sliding
window layer of width W, k > p - W (the window holds W tokens, itself
included, as in transformers). `scaled_dot_product_attention` does the work
unless the layer softcaps its scores (Gemma 2), which needs explicit scores.
`single_query_attention` is the decode step's case: one query over keys it
may all see, so no mask at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention needs besides q, k and v."""

    scale: float  # multiplier of q.k
    sliding_window: int | None = None  # tokens a query sees, itself included
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)


def attention_mask(q_positions: Tensor, kv_positions: Tensor, sliding_window: int | None) -> Tensor:
    """Boolean mask [B, 1, T, S], True where a query may attend.

    q_positions is [B, T]; kv_positions is [S] (a dense cache) or [B, S].
    """
    q = q_positions[:, :, None]  # [B, T, 1]
    k = kv_positions.view(-1, 1, kv_positions.shape[-1])  # [B or 1, 1, S]
    mask = k <= q
    if sliding_window is not None:
        mask = mask & (k > q - sliding_window)
    return mask[:, None]  # [B, 1, T, S]


def attention(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, kv_positions: Tensor,
              spec: AttentionSpec) -> Tensor:
    """Causal (optionally windowed, softcapped) attention with grouped KV heads.

    q [B, H, T, D], k and v [B, KV, S, D] with H a multiple of KV -> [B, H, T, D].
    """
    mask = attention_mask(q_positions, kv_positions, spec.sliding_window)
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # [B, H, S, D]
    v = v.repeat_interleave(groups, dim=1)  # [B, H, S, D]
    scores = (q @ k.transpose(2, 3)) * spec.scale  # [B, H, T, S]
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return weights @ v


def single_query_attention(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> Tensor:
    """One query per row over every key given (the caller has cut them to what it may see).

    q [B, H, 1, D], k and v [B, KV, S, D] -> [B, H, 1, D]. Plain matmuls in
    float32 (softmax's precision anyway): on a busy CPU,
    scaled_dot_product_attention took ~10 ms here (a flash kernel with a
    parallel region per head for a few thousand multiply-adds). Cutting k
    and v to the window replaces the mask.
    """
    B, H, _, D = q.shape
    kv_heads = k.shape[1]
    qg = q.float().view(B, kv_heads, H // kv_heads, D)  # [B, KV, G, D]: the G query heads of each KV head
    scores = torch.matmul(qg, k.float().transpose(2, 3)) * spec.scale  # [B, KV, G, S]
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v.float()).to(q.dtype).view(B, H, 1, D)  # [B, KV, G, D] -> [B, H, 1, D]


class NoCache:
    """Attention within one call only: the prompt attends to itself, nothing is kept."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               spec: AttentionSpec) -> Tensor:
        return attention(q, k, v, positions, positions, spec)


def two_tier_attention(q: Tensor, k: Tensor, v: Tensor, k_cold: Tensor, v_cold: Tensor, q_positions: Tensor,
                       kv_positions: Tensor, cold_edges: Tensor, spec: AttentionSpec,
                       chunk: int = 512) -> Tensor:
    """attention() where a query reads the keys and values before its cold edge from k_cold, v_cold.

    q [B, H, T, D]; k, v, k_cold, v_cold [B, KV, S, D] at kv_positions
    arange(S); q_positions and cold_edges [B, T]. Explicit scores (two
    sources per key), in chunks of queries, each over the keys up to its
    last query, so an 8k prompt's scores stay ~[H, 512, 8k]. (kv_quant.py
    says which tokens are cold.)
    """
    groups = q.shape[1] // k.shape[1]
    k, v, k_cold, v_cold = (t.repeat_interleave(groups, dim=1) for t in (k, v, k_cold, v_cold))  # [B, H, S, D]
    out = []
    for start in range(0, q.shape[2], chunk):
        qc, q_pos = q[:, :, start:start + chunk], q_positions[:, start:start + chunk]  # [B, H, t, D], [B, t]
        end = min(int(q_pos.max()) + 1, k.shape[2])  # the causal mask hides every later key
        kc, vc, kc_cold, vc_cold = (t[:, :, :end] for t in (k, v, k_cold, v_cold))
        kv_pos = kv_positions[..., :end]
        cold = (kv_pos.view(-1, 1, end) < cold_edges[:, start:start + chunk, None])[:, None]  # [B, 1, t, end]
        scores = torch.where(cold, qc @ kc_cold.transpose(2, 3), qc @ kc.transpose(2, 3)) * spec.scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        mask = attention_mask(q_pos, kv_pos, spec.sliding_window)
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        out.append(weights.masked_fill(~cold, 0) @ vc_cold + weights.masked_fill(cold, 0) @ vc)  # [B, H, t, D]
    return torch.cat(out, dim=2)
