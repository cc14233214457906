"""Attention over the two-tier paged cache, in torch: cold blocks dequantized as they are gathered.

A sequence's block table holds `cold_blocks[i]` ids of the cold pool, then
hot ones (block_manager.py). Each layer gathers a sequence's blocks from
both pools, dequantizing the cold ones (kv_cache.ColdPool.blocks), and then
attends as the torch backend does. Decode steps need nothing more: the
scheduler demoted every block their query reads cold. A prompt chunk may
have later queries that read cold blocks still in the hot pool: those
blocks are quantized on the fly (the numbers the cold pool will hold) and
each query reads the keys before its own cold edge from them
(two_tier_attention), so a prompt gives what token-by-token decoding would,
and what the dense engine's TwoTierDenseKVCache gives. This path runs on
every device; on CUDA the Triton backend's attend_cold (triton.py)
does the same in its kernel and leaves this path only prompt chunks that
quantize blocks on the fly with blocks over the kernel's 32-token key tile.
"""
from __future__ import annotations

import torch
from torch import Tensor

from native_server.engine.attention.interface import PagedMetadata
from native_server.engine.attention.torch_path import Gather, chunk_context, decode_rows
from py_engine.models.attention import AttentionSpec, attention, two_tier_attention
from py_engine.models.kv_quant import KVQuantConfig, fake_quantize_blocks


def two_tier_gather(key_cache: Tensor, value_cache: Tensor, pool, layer: int, counts: Tensor) -> Gather:
    """The torch path's gather over both pools: of each table [S, nb] the first counts[seq] ids are cold blocks,
    dequantized as they are read (kv_cache.ColdPool.blocks); the rest are hot. Keys and values [S, KV, nb * bs, D]."""
    def gather(tables: Tensor, seqs: Tensor | slice) -> tuple[Tensor, Tensor]:
        S, nb = tables.shape
        _, block_size, kv_heads, head_dim = key_cache.shape
        is_cold = torch.arange(nb, device=tables.device)[None] < counts[seqs][:, None]  # [S, nb]
        hot_ids = tables.masked_fill(is_cold, 0)
        keys, values = key_cache[hot_ids], value_cache[hot_ids]  # [S, nb, bs, KV, D], copies
        if bool(is_cold.any()):
            keys[is_cold], values[is_cold] = pool.blocks(layer, tables[is_cold], key_cache.dtype)
        shape = (S, nb * block_size, kv_heads, head_dim)
        return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
    return gather


def attend(q: Tensor, key_cache: Tensor, value_cache: Tensor, pool, layer: int, meta: PagedMetadata,
           spec: AttentionSpec, quant: KVQuantConfig) -> Tensor:
    """q [N, H, D] -> [N, H, D] (the TorchPagedAttention contract) over hot and cold blocks."""
    out = torch.empty_like(q)
    counts = torch.tensor(meta.cold_blocks, dtype=torch.long, device=q.device)  # [S]
    if meta.decode_seqs.numel():
        gather = two_tier_gather(key_cache, value_cache, pool, layer, counts)
        out[meta.decode_tokens] = decode_rows(q, meta, spec, gather, key_cache.shape[1])
    for i in meta.prefill_seqs:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        out[start:end] = attend_chunk(q[start:end], key_cache, value_cache, pool, layer, meta, i, counts, spec, quant)
    return out


def attend_chunk(q: Tensor, key_cache: Tensor, value_cache: Tensor, pool, layer: int, meta: PagedMetadata, i: int,
                 counts: Tensor, spec: AttentionSpec, quant: KVQuantConfig) -> Tensor:
    """Several queries of sequence i: q [T, H, D] -> [T, H, D]. Blocks a later query reads cold while they are
    still hot (this chunk's own) are quantized on the fly, each query reading the keys before its cold edge so."""
    block_size = key_cache.shape[1]
    gather = two_tier_gather(key_cache, value_cache, pool, layer, counts)
    keys, values, q_pos, kv_pos = chunk_context(meta, i, block_size, gather, q.device)  # [1, KV, length, D]
    qi, dt = q.transpose(0, 1)[None], q.dtype  # [1, H, T, D]
    edges = quant.cold_edges(q_pos)  # [1, T]
    settled, top = meta.cold_blocks[i] * block_size, int(edges.max())
    if top <= settled:  # every block a query here reads cold is in the cold pool
        return attention(qi, keys.to(dt), values.to(dt), q_pos, kv_pos, spec)[0].transpose(0, 1)
    cold_keys = keys.clone(memory_format=torch.contiguous_format)  # [1, KV, length, D]
    cold_values = values.clone(memory_format=torch.contiguous_format)
    n = (top - settled) // block_size
    blocks_k = cold_keys[:, :, settled:top].view(1, keys.shape[1], n, block_size, keys.shape[3])
    blocks_v = cold_values[:, :, settled:top].view(1, keys.shape[1], n, block_size, keys.shape[3])
    fake_k, fake_v = fake_quantize_blocks(blocks_k, blocks_v, quant.bits)
    blocks_k.copy_(fake_k)
    blocks_v.copy_(fake_v)
    out = two_tier_attention(qi, keys.to(dt), values.to(dt), cold_keys.to(dt), cold_values.to(dt), q_pos, kv_pos,
                             edges, spec)  # [1, H, T, D]
    return out[0].transpose(0, 1)
