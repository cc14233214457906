"""The device interface of the paged KV cache: its layout, the step's metadata, and what a backend does.

Layout: per layer one key and one value tensor [num_blocks, block_size,
kv_heads, head_dim]; token slot s is block s // block_size, offset
s % block_size, and a block's kv_heads x head_dim values are contiguous
(the layout of vLLM's flash-attention backend, so a kernel reads one
block of one head as a [block_size, head_dim] tile).

Backends (this package's __init__ picks one with `backend_for`):
`TorchPagedAttention` (reference.py), plain torch and the oracle, any device;
`CpuPagedAttention` (cpu.py), decode rows in C (py_engine/kernels/paged.c);
`TritonPagedAttention` (triton.py), CUDA, kernels in py_engine/gpu/. With an
int8/int4 KV cache some blocks are cold (kv_cache.ColdPool): `attend_cold`
reads both pools (cold.py is the torch path every backend may fall back on).
This module imports no backend, so every backend can import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from py_engine.models.attention import AttentionSpec
from py_engine.models.kv_quant import KVQuantConfig

BACKENDS = ("auto", "torch", "triton", "cpu")

# Positions of padding slots: past any query position, so the causal mask hides them.
_PAD_POSITION = 2**62


@dataclass
class PagedMetadata:
    """Where this step's tokens go and what each sequence sees; built once per step, used by every layer.

    N tokens of S sequences, flattened: sequence i owns tokens
    query_start[i]:query_start[i + 1] and, after this step's writes, its
    first context_lens[i] slots through block_tables[i].
    """

    slot_mapping: Tensor  # [N] long: the cache slot each new token's k/v goes to
    positions: Tensor  # [N] long
    query_start: list[int]  # [S + 1]
    context_lens: list[int]  # [S]
    block_tables: Tensor  # [S, max_blocks] long, padded with block 0
    decode_seqs: Tensor  # [Sd] long: sequences with exactly one new token
    decode_tokens: Tensor  # [Sd] long: that token's index in the flattened batch
    decode_kv_positions: Tensor  # [Sd, L] long: slot positions of their padded contexts, padding past the end
    prefill_seqs: list[int]  # sequences with several new tokens
    kernel_inputs: Any = None  # what the backend's prepare() derived from the above, once per step
    kernel_rows: Any = None  # the same for every token's row (the CPU backend: prompt chunks as decode rows)
    cold_blocks: list[int] | None = None  # [S]: leading ids of each table in the cold pool (int8/int4 KV)


def decode_kv_positions(context_lens: Tensor, block_size: int) -> Tensor:
    """[Sd] context lengths -> [Sd, L] positions 0..L-1, L a whole number of blocks; slots past a
    sequence's length get a position after every query, so the causal mask hides them."""
    if not context_lens.numel():
        return context_lens.new_zeros((0, 0))
    length = -(-int(context_lens.max()) // block_size) * block_size
    positions = torch.arange(length, device=context_lens.device).expand(len(context_lens), -1)  # [Sd, L]
    return positions.masked_fill(positions >= context_lens[:, None], _PAD_POSITION)


class PagedAttentionBackend(Protocol):
    name: str

    def prepare(self, meta: PagedMetadata) -> PagedMetadata:
        """Once per step, before the first layer: meta with the backend's own inputs (kernel_inputs) set."""
        ...

    def write(self, key_cache: Tensor, value_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store k, v [N, KV, D] at their slots of the caches [num_blocks, block_size, KV, D]."""
        ...

    def attend(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, meta: PagedMetadata,
               spec: AttentionSpec) -> Tensor:
        """q [N, H, D] -> [N, H, D], each token attending over its sequence's cached context."""
        ...

    def attend_cold(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, cold: Any, layer: int,
                    meta: PagedMetadata, spec: AttentionSpec, quant: KVQuantConfig) -> Tensor:
        """attend() over a two-tier cache, some block cold: `cold` is the layer's kv_cache.ColdPool, `quant`
        its settings (which positions a query reads cold). Same shapes as attend()."""
        ...


