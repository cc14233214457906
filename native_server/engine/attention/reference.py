"""`TorchPagedAttention`: the reference paged attention in plain torch, the oracle every faster backend meets.

It runs on CPU, CUDA and MPS. It gathers each sequence's blocks through its
block table and calls the reference `attention()` (so masks, sliding
windows, softcapping and GQA are the dense cache's own): sequences with one
new token (decoding) go through one padded batched call; sequences with
several (a prompt chunk) one call each. Over a two-tier cache it is cold.py's
torch path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from native_server.engine.attention import cold
from native_server.engine.attention.interface import PagedMetadata
from py_engine.models.attention import AttentionSpec, attention
from py_engine.models.kv_quant import KVQuantConfig


class TorchPagedAttention:
    """The reference implementation, in plain torch, for any device."""

    name = "torch"

    def prepare(self, meta: PagedMetadata) -> PagedMetadata:
        return meta

    def write(self, key_cache: Tensor, value_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        num_blocks, block_size, kv_heads, head_dim = key_cache.shape
        slots = num_blocks * block_size
        key_cache.view(slots, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
        value_cache.view(slots, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(value_cache.dtype))

    def attend(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, meta: PagedMetadata,
               spec: AttentionSpec) -> Tensor:
        out = torch.empty_like(q)
        if meta.decode_seqs.numel():
            out[meta.decode_tokens] = self._decode(q[meta.decode_tokens], key_cache, value_cache, meta, spec)
        for i in meta.prefill_seqs:
            start, end = meta.query_start[i], meta.query_start[i + 1]
            out[start:end] = self._prefill(q[start:end], key_cache, value_cache, meta, i, spec)
        return out

    def _decode(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, meta: PagedMetadata,
                spec: AttentionSpec) -> Tensor:
        """One query per sequence, all sequences padded to the longest context: q [Sd, H, D] -> [Sd, H, D]."""
        kv_pos = meta.decode_kv_positions  # [Sd, L]
        tables = meta.block_tables[meta.decode_seqs, :kv_pos.shape[1] // key_cache.shape[1]]  # [Sd, nb]
        keys = _gather(key_cache, tables)  # [Sd, KV, L, D]
        values = _gather(value_cache, tables)  # [Sd, KV, L, D]
        q_pos = meta.positions[meta.decode_tokens][:, None]  # [Sd, 1]
        out = attention(q[:, :, None], keys.to(q.dtype), values.to(q.dtype), q_pos, kv_pos, spec)  # [Sd, H, 1, D]
        return out[:, :, 0]

    def _prefill(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, meta: PagedMetadata, i: int,
                 spec: AttentionSpec) -> Tensor:
        """Several queries of sequence i: q [T, H, D] -> [T, H, D]."""
        length = meta.context_lens[i]
        num_blocks = -(-length // key_cache.shape[1])
        table = meta.block_tables[i:i + 1, :num_blocks]  # [1, nb]
        keys = _gather(key_cache, table)[:, :, :length]  # [1, KV, length, D]
        values = _gather(value_cache, table)[:, :, :length]  # [1, KV, length, D]
        start, end = meta.query_start[i], meta.query_start[i + 1]
        q_pos = meta.positions[start:end][None]  # [1, T]
        kv_pos = torch.arange(length, device=q.device)  # [length]
        out = attention(q.transpose(0, 1)[None], keys.to(q.dtype), values.to(q.dtype), q_pos, kv_pos, spec)
        return out[0].transpose(0, 1)  # [1, H, T, D] -> [T, H, D]

    def attend_cold(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, pool, layer: int,
                    meta: PagedMetadata, spec: AttentionSpec, quant: KVQuantConfig) -> Tensor:
        return cold.attend(q, key_cache, value_cache, pool, layer, meta, spec, quant)


def _gather(cache: Tensor, tables: Tensor) -> Tensor:
    """The blocks of each table, in order: cache [blocks, bs, KV, D], tables [S, nb] -> [S, KV, nb * bs, D]."""
    S, nb = tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    blocks = cache[tables]  # [S, nb, bs, KV, D]
    return blocks.view(S, nb * block_size, kv_heads, head_dim).transpose(1, 2)
