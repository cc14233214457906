"""The CPU backend of paged attention: every token's row in C (py_engine/kernels/paged.c).

`backend_for` picks it on the CPU when the kernels load. Each token attends
over its block table up to its own position in one C call per layer for the
whole batch (a decode row, and each token of a prompt chunk as if it were
one), reading hot blocks in place: no gathered copies, no padding to the
longest context, and one arithmetic for a token however it is scheduled
(cached, chunked, batched or verified speculatively). With int8/int4 KV the
decode rows read the cold pool's codes dequantized on the fly, while prompt
chunks keep the torch path (cold.py); reference.py stays the oracle the
tests hold this backend to. The torch path also runs where the kernel refuses the
shapes (py_engine.kernels.paged.supported says why: head_dim not a multiple
of 8, queries other than fp32/bf16 or caches other than fp32/bf16/fp16, groups
too large for its stack arrays). A 16-bit cache (--kv-cache-dtype fp16 / bf16)
beside fp32 queries is read in place, widened to fp32 as the kernel goes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from native_server.engine.attention import cold
from native_server.engine.attention.interface import PagedMetadata
from native_server.engine.attention.reference import TorchPagedAttention
from py_engine.kernels import CpuKernels
from py_engine.kernels.paged import PagedDecode, paged_decode, supported
from py_engine.models.attention import AttentionSpec
from py_engine.models.kv_quant import KVQuantConfig


class CpuPagedAttention(TorchPagedAttention):
    """TorchPagedAttention with its decode rows in C."""

    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self._refusals: dict[tuple, str | None] = {}  # supported()'s answer per layout, asked once

    def prepare(self, meta: PagedMetadata) -> PagedMetadata:
        """Once per step: the rows paged.c attends, as it reads them. kernel_inputs: the decode rows (the cold
        path's); rows: every token, a prompt chunk's too, each with its own context length, so that each
        token is computed exactly as a decode row would compute it (a prompt cached, chunked or batched, and
        a speculative step's k + 1 rows, give a token the bits decode gives it)."""
        meta.kernel_inputs = meta.kernel_rows = None
        if meta.block_tables.device.type != "cpu":
            return meta
        if meta.decode_seqs.numel():
            lens = torch.tensor(meta.context_lens)[meta.decode_seqs]  # [Sd]
            n_cold = None
            if meta.cold_blocks is not None and any(meta.cold_blocks):
                n_cold = torch.tensor(meta.cold_blocks)[meta.decode_seqs]  # [Sd]
            meta.kernel_inputs = PagedDecode.for_rows(meta.block_tables, meta.decode_seqs, meta.decode_tokens, lens,
                                                      n_cold)
        if not meta.prefill_seqs:
            meta.kernel_rows = meta.kernel_inputs
            return meta
        counts = torch.tensor([b - a for a, b in zip(meta.query_start, meta.query_start[1:])])  # [S]
        seqs = torch.repeat_interleave(torch.arange(len(counts)), counts)  # [N]: each token's sequence
        first = torch.tensor(meta.query_start[:-1])[seqs]  # [N]: its sequence's first token in the batch
        tokens = torch.arange(len(seqs))  # [N]
        lens = torch.tensor(meta.context_lens)[seqs] - counts[seqs] + (tokens - first) + 1  # [N]: its position + 1
        meta.kernel_rows = PagedDecode.for_rows(meta.block_tables, seqs, tokens, lens)
        return meta

    def _rows_in_c(self, q: Tensor, key_cache: Tensor, rows: PagedDecode | None) -> bool:
        if rows is None:
            return False
        layout = (q.dtype, q.device, q.shape[1:], q.stride(2), key_cache.dtype, key_cache.device, key_cache.shape[1:],
                  key_cache.is_contiguous())
        if layout not in self._refusals:
            self._refusals[layout] = supported(self.kernels, q, key_cache)
        return self._refusals[layout] is None

    def _decode_in_c(self, q: Tensor, key_cache: Tensor, meta: PagedMetadata) -> bool:
        return self._rows_in_c(q, key_cache, meta.kernel_inputs)

    def attend(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, meta: PagedMetadata,
               spec: AttentionSpec) -> Tensor:
        if not self._rows_in_c(q, key_cache, meta.kernel_rows):
            return super().attend(q, key_cache, value_cache, meta, spec)
        return paged_decode(self.kernels, meta.kernel_rows, q, key_cache, value_cache, spec.scale,
                            spec.sliding_window, spec.softcap)

    def attend_cold(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, pool, layer: int,
                    meta: PagedMetadata, spec: AttentionSpec, quant: KVQuantConfig) -> Tensor:
        """cold.attend's contract (some block is cold): decode rows read the cold pool's codes in C."""
        if not self._decode_in_c(q, key_cache, meta):
            return cold.attend(q, key_cache, value_cache, pool, layer, meta, spec, quant)
        codes = (pool.key_codes[layer], pool.value_codes[layer], pool.key_scales[layer], pool.key_zeros[layer],
                 pool.value_scales[layer], pool.value_zeros[layer])
        out = paged_decode(self.kernels, meta.kernel_inputs, q, key_cache, value_cache, spec.scale,
                           spec.sliding_window, spec.softcap, codes, quant.bits)
        if meta.prefill_seqs:
            counts = torch.tensor(meta.cold_blocks, dtype=torch.long)  # [S]
            for i in meta.prefill_seqs:
                start, end = meta.query_start[i], meta.query_start[i + 1]
                out[start:end] = cold.attend_chunk(q[start:end], key_cache, value_cache, pool, layer, meta, i,
                                                   counts, spec, quant)
        return out
