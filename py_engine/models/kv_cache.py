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
quantized, once, into codes beside them (`ColdCodes`), and replaced in the
buffers by their dequantized values. The torch paths read the buffers, so
they attend exactly as the server's cold pool would make them; the C decode
step (py_engine.cpu) reads the codes, a quarter to an eighth of the bytes.
It saves no memory (the buffers stay): that is the server's paged cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..config import ModelConfig
from .attention import AttentionSpec, attention, single_query_attention, two_tier_attention
from .kv_quant import KVQuantConfig, dequantize, fake_quantize_blocks, pack, quantize


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
                 layers: int | None = None, quant: KVQuantConfig | None = None) -> "DenseKVCache":
        """A cache of zeros; a TwoTierDenseKVCache when `quant` asks for int8 or int4 cold blocks.
        layers: how many layers to hold, the model's by default (X-LoRA keeps two caches in one: 2 x)."""
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        layers = range(config.num_hidden_layers if layers is None else layers)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        if quant is not None and quant.enabled:
            codes = [ColdCodes.allocate(shape, quant, device) for _ in layers]
            return TwoTierDenseKVCache(keys, values, quant, codes=codes)
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
class ColdCodes:
    """One layer's cold tier beside the buffers [B, KV, max_len, D]: keys per channel, codes [B, KV, blocks,
    block_size, D * bits / 8], scales and zeros [B, KV, blocks, D]; values per token, codes [B, KV, max_len,
    D * bits / 8], scales and zeros [B, KV, max_len] (kernels/decode.c's cold_t reads row 0)."""

    key_codes: Tensor
    key_scales: Tensor
    key_zeros: Tensor
    value_codes: Tensor
    value_scales: Tensor
    value_zeros: Tensor

    @classmethod
    def allocate(cls, shape: tuple[int, ...], quant: KVQuantConfig, device) -> "ColdCodes":
        B, KV, max_len, D = shape
        blocks, packed = max_len // quant.block_size, D * quant.bits // 8

        def zeros(*s: int, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.zeros(s, dtype=dtype, device=device)
        return cls(zeros(B, KV, blocks, quant.block_size, packed, dtype=torch.uint8), zeros(B, KV, blocks, D),
                   zeros(B, KV, blocks, D), zeros(B, KV, max_len, packed, dtype=torch.uint8), zeros(B, KV, max_len),
                   zeros(B, KV, max_len))

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.key_codes, self.key_scales, self.key_zeros, self.value_codes, self.value_scales,
                self.value_zeros)


@dataclass
class TwoTierDenseKVCache(DenseKVCache):
    """DenseKVCache whose tokens before `settled` are cold: in `codes`, and dequantized in the buffers."""

    quant: KVQuantConfig = KVQuantConfig()
    settled: int = 0  # a block edge: tokens [0, settled) are cold in every row
    codes: list[ColdCodes] | None = None

    def settle(self, position: int) -> None:
        """Quantize, in every layer, the blocks a query at `position` reads cold: no query from there on
        reads them hot. The decode kernels call this before a step; attend() for layer 0."""
        edge = self.quant.cold_edge(position)
        if edge <= self.settled:
            return
        bits, bs, start = self.quant.bits, self.quant.block_size, self.settled
        for keys, values, codes in zip(self.keys, self.values, self.codes):
            k, v = self._blocks(keys, start, edge), self._blocks(values, start, edge)  # [B, KV, n, bs, D]
            B, KV, n, _, D = k.shape
            kq, ks, kz = quantize(k, -2, bits)  # per channel: over the block's tokens
            vq, vs, vz = quantize(v, -1, bits)  # per token: over the head's channels
            blocks = slice(start // bs, edge // bs)
            codes.key_codes[:, :, blocks] = pack(kq, bits)
            codes.key_scales[:, :, blocks], codes.key_zeros[:, :, blocks] = ks[..., 0, :], kz[..., 0, :]
            codes.value_codes[:, :, start:edge] = pack(vq, bits).view(B, KV, n * bs, -1)
            codes.value_scales[:, :, start:edge] = vs.view(B, KV, n * bs)
            codes.value_zeros[:, :, start:edge] = vz.view(B, KV, n * bs)
            k.copy_(dequantize(kq, ks, kz, keys.dtype))  # fake_quantize_blocks' numbers, for the torch paths
            v.copy_(dequantize(vq, vs, vz, values.dtype))
        self.settled = edge

    def take_cold(self, old: "TwoTierDenseKVCache") -> None:
        """Adopt old's cold tier (a smaller cache of the same sequence whose buffers were copied here)."""
        blocks, tokens = old.settled // self.quant.block_size, old.settled
        for mine, theirs in zip(self.codes, old.codes):
            for i, (a, b) in enumerate(zip(mine.tensors(), theirs.tensors())):  # keys by block, values by token
                n = blocks if i < 3 else tokens
                a[:, :, :n].copy_(b[:, :, :n])
        self.settled = old.settled

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
