"""The torch path's pieces, shared by the reference backend and the two-tier one (cold.py).

Both gather each sequence's blocks through its block table, then call the
reference `attention()`: decode rows (one new token each) in one padded
batched call, a prompt chunk in a call of its own. Only the gather differs:
hot blocks as they are (`hot_gather`), or hot and cold ones dequantized
(cold.py's). So the two paths are one path with a gather passed in.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from native_server.engine.attention.interface import PagedMetadata
from py_engine.models.attention import AttentionSpec, attention

# (tables [S, nb], which sequences of the step they are: an index tensor or slice) -> keys, values
# [S, KV, nb * bs, D], the blocks of each table in order.
Gather = Callable[[Tensor, "Tensor | slice"], tuple[Tensor, Tensor]]


def gather_blocks(cache: Tensor, tables: Tensor) -> Tensor:
    """The blocks of each table, in order: cache [blocks, bs, KV, D], tables [S, nb] -> [S, KV, nb * bs, D]."""
    S, nb = tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    blocks = cache[tables]  # [S, nb, bs, KV, D]
    return blocks.view(S, nb * block_size, kv_heads, head_dim).transpose(1, 2)


def hot_gather(key_cache: Tensor, value_cache: Tensor) -> Gather:
    """Every block read from the caches as it is."""
    return lambda tables, seqs: (gather_blocks(key_cache, tables), gather_blocks(value_cache, tables))


def decode_rows(q: Tensor, meta: PagedMetadata, spec: AttentionSpec, gather: Gather, block_size: int) -> Tensor:
    """The decode tokens' outputs: one query per sequence, every sequence padded to the longest context.
    q [N, H, D] (the step's queries) -> [Sd, H, D] (the rows of meta.decode_tokens)."""
    kv_pos = meta.decode_kv_positions  # [Sd, L]
    tables = meta.block_tables[meta.decode_seqs, :kv_pos.shape[1] // block_size]  # [Sd, nb]
    keys, values = gather(tables, meta.decode_seqs)  # [Sd, KV, L, D] each
    q_pos = meta.positions[meta.decode_tokens][:, None]  # [Sd, 1]
    qd = q[meta.decode_tokens][:, :, None]  # [Sd, H, 1, D]
    return attention(qd, keys.to(q.dtype), values.to(q.dtype), q_pos, kv_pos, spec)[:, :, 0]


def chunk_context(meta: PagedMetadata, i: int, block_size: int, gather: Gather,
                  device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What sequence i's prompt chunk attends over: keys and values [1, KV, length, D], its queries' positions
    [1, T] and the keys' [length]."""
    length = meta.context_lens[i]
    table = meta.block_tables[i:i + 1, :-(-length // block_size)]  # [1, nb]
    keys, values = gather(table, slice(i, i + 1))  # [1, KV, nb * bs, D]
    start, end = meta.query_start[i], meta.query_start[i + 1]
    q_pos = meta.positions[start:end][None]  # [1, T]
    return keys[:, :, :length], values[:, :, :length], q_pos, torch.arange(length, device=device)


def attend_chunk(q: Tensor, meta: PagedMetadata, i: int, spec: AttentionSpec, gather: Gather,
                 block_size: int) -> Tensor:
    """Several queries of sequence i: q [T, H, D] -> [T, H, D]."""
    keys, values, q_pos, kv_pos = chunk_context(meta, i, block_size, gather, q.device)
    out = attention(q.transpose(0, 1)[None], keys.to(q.dtype), values.to(q.dtype), q_pos, kv_pos, spec)
    return out[0].transpose(0, 1)  # [1, H, T, D] -> [T, H, D]
