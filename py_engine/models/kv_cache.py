"""KV caches: where a layer writes its keys and values and then attends.

A cache is any object with `attend(layer, q, k, v, positions, spec)`: it
stores the new k and v for `layer` at `positions` and returns the attention
of q over everything the sequence has so far. The model knows nothing else
about it, so the server's paged cache drops in behind the same call.

`DenseKVCache` is the reference: one [B, kv_heads, max_len, head_dim] buffer
per layer and per k/v, row b holding the sequence of batch row b at its
positions. Sliding-window layers keep the full length too; the mask, not
the storage, applies the window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..config import ModelConfig
from .attention import AttentionSpec, attention, single_query_attention


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
                 layers: int | None = None) -> "DenseKVCache":
        """layers: how many layers to hold, the model's by default (X-LoRA keeps two caches in one: 2 x)."""
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        layers = range(config.num_hidden_layers if layers is None else layers)
        return cls(keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
                   values=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers])

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               spec: AttentionSpec) -> Tensor:
        length = int(positions.max()) + 1  # the filled prefix this call can see
        if length > self.max_len or positions.shape[0] != self.batch:
            raise ValueError(f"positions {tuple(positions.shape)} up to {length - 1} do not fit a cache of "
                             f"batch {self.batch} and max_len {self.max_len}")
        if positions.shape == (1, 1):  # one sequence decoding: it sees all it has, no mask needed
            return self._decode_one(layer, q, k, v, length, spec)
        index = positions[:, None, :, None].expand(k.shape)  # [B, KV, T, D]
        self.keys[layer].scatter_(2, index, k.to(self.keys[layer].dtype))
        self.values[layer].scatter_(2, index, v.to(self.values[layer].dtype))
        keys = self.keys[layer][:, :, :length]  # [B, KV, length, D]
        values = self.values[layer][:, :, :length]  # [B, KV, length, D]
        kv_positions = torch.arange(length, device=positions.device)  # [length]
        return attention(q, keys.to(q.dtype), values.to(q.dtype), positions, kv_positions, spec)

    def _decode_one(self, layer: int, q: Tensor, k: Tensor, v: Tensor, length: int,
                    spec: AttentionSpec) -> Tensor:
        """Write k, v [1, KV, 1, D] at position length - 1, attend over the prefix (or window)."""
        self.keys[layer][:, :, length - 1] = k[:, :, 0]
        self.values[layer][:, :, length - 1] = v[:, :, 0]
        start = 0 if spec.sliding_window is None else max(0, length - spec.sliding_window)
        keys = self.keys[layer][:, :, start:length]  # [1, KV, seen, D]
        values = self.values[layer][:, :, start:length]  # [1, KV, seen, D]
        return single_query_attention(q, keys, values, spec)
