"""The device interface of the paged KV cache: its layout, writing new k/v, attending through block tables.

Layout: per layer one key and one value tensor [num_blocks, block_size,
kv_heads, head_dim]; token slot s is block s // block_size, offset
s % block_size, and a block's kv_heads x head_dim values are contiguous
(the layout of vLLM's flash-attention backend, so a kernel reads one
block of one head as a [block_size, head_dim] tile).

`TorchPagedAttention` is plain torch and the oracle: it runs on CPU, CUDA and
MPS, and every faster backend is tested against it on the same inputs. It
gathers each sequence's blocks through its block table and calls the
reference `attention()` (so masks, sliding windows, softcapping and GQA are
the dense cache's own): sequences with one new token (decoding) go through
one padded batched call; sequences with several (a prompt chunk) one call each.

`TritonPagedAttention` (triton_attention.py, kernels in py_engine/gpu/) is the
CUDA backend: `backend_for` picks it on CUDA when Triton imports.
`CpuPagedAttention` (cpu_attention.py) is the CPU's: decode rows in C
(py_engine/kernels/paged.c), prompt chunks in torch; `backend_for` picks it on
the CPU when the kernels load. MPS keeps the torch path (Triton has no Metal backend).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from py_engine.gpu import triton_problem
from py_engine.models.attention import AttentionSpec, attention

logger = logging.getLogger("ruvllm.server")
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


def _gather(cache: Tensor, tables: Tensor) -> Tensor:
    """The blocks of each table, in order: cache [blocks, bs, KV, D], tables [S, nb] -> [S, KV, nb * bs, D]."""
    S, nb = tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    blocks = cache[tables]  # [S, nb, bs, KV, D]
    return blocks.view(S, nb * block_size, kv_heads, head_dim).transpose(1, 2)


def backend_for(device: torch.device | str, name: str = "auto") -> PagedAttentionBackend:
    """The attention backend: "torch" (the oracle, any device), "triton" (CUDA; the CPU only under
    TRITON_INTERPRET=1), "cpu" (the C kernels' decode rows) or "auto" (Triton on CUDA when it imports,
    the C kernels on the CPU when they load, else torch)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _cpu_backend(device, required=name == "cpu")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchPagedAttention()
    problem = triton_problem(device)
    if problem is None:
        try:
            from native_server.triton_attention import TritonPagedAttention
            return TritonPagedAttention()
        except Exception as exc:  # noqa: BLE001 - a broken install (no driver, no compiler): say which
            problem = f"triton failed to import ({type(exc).__name__}: {exc})"
    if name == "triton":
        raise ValueError(f"--attention-backend triton cannot run here: {problem}")
    logger.warning("attention: the torch path on %s (%s)", device, problem)
    return TorchPagedAttention()


def _cpu_backend(device: torch.device, required: bool) -> PagedAttentionBackend:
    """CpuPagedAttention where the kernels load; else torch, or an error when it was asked for by name."""
    from py_engine.kernels import cpu_kernels

    kernels = cpu_kernels() if device.type == "cpu" else None
    if kernels is None:
        if required:
            raise ValueError(f"--attention-backend cpu cannot run here: the CPU kernels do not load on {device} "
                             "(x86-64 Linux with AVX2 and a C compiler; RUVLLM_NO_KERNELS unset)")
        return TorchPagedAttention()
    from native_server.cpu_attention import CpuPagedAttention
    return CpuPagedAttention(kernels)
