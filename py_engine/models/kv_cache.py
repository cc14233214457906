"""KV caches: where a layer writes its keys and values and then attends.

A cache is any object with `attend(layer, q, k, v, positions, spec)`: it
stores the new k and v for `layer` at `positions` and returns the attention
of q over everything the sequence has so far. The model knows nothing else
about it, so the server's paged cache drops in behind the same call.

`DenseKVCache` is the reference: one [B, kv_heads, max_len, head_dim] buffer
per layer and per k/v, row b holding the sequence of batch row b at its
positions. Sliding-window layers keep the full length too; the mask, not
the storage, applies the window.

`TwoTierDenseKVCache` is the two-tier cache of one or a few sequences
(kv_quant.py): the same buffers, whose blocks past the hot window are
replaced, once, by their dequantized int8/int4 values, so the decode paths
that read the buffers (torch, and the C kernels of py_engine.cpu) attend
exactly as the server's cold pool would make them. It saves no memory: it
is the reference arithmetic for `LLM` and `eval ppl`; the server's paged
cache is where the bytes are saved.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..config import ModelConfig
from .attention import AttentionSpec, attention, single_query_attention, two_tier_attention
from .kv_quant import KVQuantConfig, fake_quantize_blocks


class KVCache(Protocol):
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               spec: AttentionSpec) -> Tensor:
        """Store k, v [B, KV, T, D] at positions [B, T]; return attention of q [B, H, T, D]."""
        ...


@dataclass
class DenseKVCache:
    """Per-layer key and value buffers, each [B, kv_heads, max_len, head_dim]."""

    keys: list[Tensor]
    values: list[Tensor]

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 quant: KVQuantConfig | None = None) -> "DenseKVCache":
        """A cache of zeros; a TwoTierDenseKVCache when `quant` asks for int8 or int4 cold blocks."""
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        layers = range(config.num_hidden_layers)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        if quant is not None and quant.enabled:
            return TwoTierDenseKVCache(keys, values, quant)
        return cls(keys=keys, values=values)

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               spec: AttentionSpec) -> Tensor:
        length = int(positions.max()) + 1  # the filled prefix this call can see
        self._check(positions, length)
        if positions.shape == (1, 1):  # one sequence decoding: it sees all it has, no mask needed
            return self._decode_one(layer, q, k, v, length, spec)
        keys, values = self._write(layer, k, v, positions, length)  # [B, KV, length, D] each
        kv_positions = torch.arange(length, device=positions.device)  # [length]
        return attention(q, keys.to(q.dtype), values.to(q.dtype), positions, kv_positions, spec)

    def _check(self, positions: Tensor, length: int) -> None:
        if length > self.max_len or positions.shape[0] != self.batch:
            raise ValueError(f"positions {tuple(positions.shape)} up to {length - 1} do not fit a cache of "
                             f"batch {self.batch} and max_len {self.max_len}")

    def _write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """Scatter k, v [B, KV, T, D] to their positions; the filled prefix [B, KV, length, D] of each buffer."""
        index = positions[:, None, :, None].expand(k.shape)  # [B, KV, T, D]
        self.keys[layer].scatter_(2, index, k.to(self.keys[layer].dtype))
        self.values[layer].scatter_(2, index, v.to(self.values[layer].dtype))
        return self.keys[layer][:, :, :length], self.values[layer][:, :, :length]

    def _decode_one(self, layer: int, q: Tensor, k: Tensor, v: Tensor, length: int,
                    spec: AttentionSpec) -> Tensor:
        """Write k, v [1, KV, 1, D] at position length - 1, attend over the prefix (or window)."""
        self.keys[layer][:, :, length - 1] = k[:, :, 0]
        self.values[layer][:, :, length - 1] = v[:, :, 0]
        start = 0 if spec.sliding_window is None else max(0, length - spec.sliding_window)
        keys = self.keys[layer][:, :, start:length]  # [1, KV, seen, D]
        values = self.values[layer][:, :, start:length]  # [1, KV, seen, D]
        return single_query_attention(q, keys, values, spec)


@dataclass
class TwoTierDenseKVCache(DenseKVCache):
    """DenseKVCache whose tokens before `settled` hold their cold blocks' dequantized values (kv_quant.py)."""

    quant: KVQuantConfig = KVQuantConfig()
    settled: int = 0  # a block edge: tokens [0, settled) are cold in every row

    def settle(self, position: int) -> None:
        """Quantize, in place and in every layer, the blocks a query at `position` reads cold: no query
        from there on reads them hot. The decode kernels call this before a step; attend() for layer 0."""
        edge = self.quant.cold_edge(position)
        if edge <= self.settled:
            return
        for keys, values in zip(self.keys, self.values):
            k, v = self._blocks(keys, self.settled, edge), self._blocks(values, self.settled, edge)
            cold_k, cold_v = fake_quantize_blocks(k, v, self.quant.bits)
            k.copy_(cold_k)
            v.copy_(cold_v)
        self.settled = edge

    def _blocks(self, buffer: Tensor, start: int, end: int) -> Tensor:
        """Tokens [start, end) of a buffer as blocks: [B, KV, blocks, block_size, D] (a view)."""
        B, KV, _, D = buffer.shape
        return buffer[:, :, start:end].view(B, KV, (end - start) // self.quant.block_size, self.quant.block_size, D)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               spec: AttentionSpec) -> Tensor:
        if layer == 0:
            self.settle(int(positions.min()))
        top = int(positions.max())
        edge = self.quant.cold_edge(top)
        if edge <= self.settled:  # every block a query here reads cold is settled: the plain path
            return super().attend(layer, q, k, v, positions, spec)
        length = top + 1  # a prompt (chunk): later queries read blocks cold that earlier ones read hot
        self._check(positions, length)
        keys, values = self._write(layer, k, v, positions, length)  # [B, KV, length, D] each
        cold_keys, cold_values = keys.clone(), values.clone()
        blocks_k, blocks_v = self._blocks(cold_keys, self.settled, edge), self._blocks(cold_values, self.settled, edge)
        fake_k, fake_v = fake_quantize_blocks(blocks_k, blocks_v, self.quant.bits)
        blocks_k.copy_(fake_k)
        blocks_v.copy_(fake_v)
        kv_positions = torch.arange(length, device=positions.device)  # [length]
        dt = q.dtype
        return two_tier_attention(q, keys.to(dt), values.to(dt), cold_keys.to(dt), cold_values.to(dt), positions,
                                  kv_positions, self.quant.cold_edges(positions), spec)
