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
from native_server.engine.attention.torch_path import attend_chunk, decode_rows, hot_gather
from py_engine.models.attention import AttentionSpec
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
        gather, block_size = hot_gather(key_cache, value_cache), key_cache.shape[1]
        if meta.decode_seqs.numel():
            out[meta.decode_tokens] = decode_rows(q, meta, spec, gather, block_size)
        for i in meta.prefill_seqs:
            start, end = meta.query_start[i], meta.query_start[i + 1]
            out[start:end] = attend_chunk(q[start:end], meta, i, spec, gather, block_size)
        return out

    def attend_cold(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, pool, layer: int,
                    meta: PagedMetadata, spec: AttentionSpec, quant: KVQuantConfig) -> Tensor:
        return cold.attend(q, key_cache, value_cache, pool, layer, meta, spec, quant)

