"""The Triton paged-attention backend: py_engine.gpu's kernels behind interface.py's PagedAttentionBackend.

Per step, `prepare` turns the metadata's host-side lists into the kernels'
small int32 tables, once for every layer: one query block per decoding
sequence (its token, table row, position, 1) and the prompt chunks' query
blocks (cut per GQA group size on first use). Each layer then runs store_kv,
one decode launch (plus its split-KV merge) and one prefill launch; together
they write every token's output. TorchPagedAttention stays the oracle.

With int8/int4 KV, `attend_cold` runs the same launches over both pools
(the kernel dequantizes cold blocks as it reads them). A prompt chunk whose
later queries read blocks of the chunk itself cold (kv_quant.py's per-query
rule) makes the step's prefill launch quantize hot blocks on the fly (FAKE);
only with blocks that do not divide the kernel's key tile (over 32 tokens)
does such a chunk keep cold.py's torch path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from native_server.engine.attention import cold
from native_server.engine.attention.interface import PagedMetadata
from py_engine.gpu.kv_store import store_kv
from py_engine.gpu.paged_attention import (PREFILL_TILE, ColdBlocks, choose_splits, paged_attention,
                                           prefill_block_tokens, query_blocks)
from py_engine.models.attention import AttentionSpec
from py_engine.models.kv_quant import KVQuantConfig


@dataclass
class TritonStep:
    """The kernels' view of one step (PagedMetadata.kernel_inputs)."""

    decode_blocks: Tensor  # [Sd, 4] int32: table row, token index, position, 1
    max_decode_len: int  # sizes the split-KV
    prefill: list[tuple[int, int, int, int]]  # per prompt chunk: table row, first token, its position, tokens
    splits: int | None = None  # fixed by a CUDA graph; None: chosen per step
    cold_counts: Tensor | None = None  # [S] int32: leading cold-pool ids of each table (int8/int4 KV)
    captured: bool = False  # a CUDA graph's step: cold_counts are device inputs, always read
    fake: bool = False  # with cold blocks: some prompt chunk quantizes blocks of its own on the fly
    torch_chunks: list[int] = field(default_factory=list)  # with cold blocks: prompt chunks left to torch
    _blocks: dict[int, Tensor] = field(default_factory=dict)
    _split: bool = False

    def prefill_blocks(self, block_q: int, device: torch.device) -> Tensor:
        if block_q not in self._blocks:
            rows = query_blocks(self.prefill, block_q)
            self._blocks[block_q] = torch.tensor(rows, dtype=torch.int32).view(-1, 4).to(device)
        return self._blocks[block_q]

    def split_cold(self, meta: PagedMetadata, quant: KVQuantConfig, block_size: int) -> None:
        """Once per step (later calls do nothing): whether some prompt chunk's last query reads cold more
        than the table's cold blocks (kv_quant's per-query rule: the kernel quantizes them on the fly), and
        where it cannot (blocks that do not divide its key tile), those chunks moved to torch's list."""
        if self._split:
            return
        keep, self._split = [], True
        for chunk, i in zip(self.prefill, meta.prefill_seqs):
            if quant.cold_edge(meta.context_lens[i] - 1) <= meta.cold_blocks[i] * block_size:
                keep.append(chunk)
            elif PREFILL_TILE % block_size == 0:
                keep.append(chunk)
                self.fake = True
            else:
                self.torch_chunks.append(i)
        self.prefill, self._blocks = keep, {}


class TritonPagedAttention:
    """Store, decode and chunked prefill in Triton (CUDA; the CPU under TRITON_INTERPRET=1 for tests)."""

    name = "triton"

    def prepare(self, meta: PagedMetadata) -> PagedMetadata:
        if isinstance(meta.kernel_inputs, TritonStep):
            return meta
        starts, lens = meta.query_start, meta.context_lens
        decode = [(i, starts[i], lens[i] - 1, 1) for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
        prefill = [(i, starts[i], lens[i] - (starts[i + 1] - starts[i]), starts[i + 1] - starts[i])
                   for i in meta.prefill_seqs]
        device = meta.slot_mapping.device
        blocks = torch.tensor(decode, dtype=torch.int32).view(-1, 4).to(device)
        counts = None if meta.cold_blocks is None else torch.tensor(meta.cold_blocks, dtype=torch.int32).to(device)
        meta.kernel_inputs = TritonStep(blocks, max((p + 1 for _, _, p, _ in decode), default=0), prefill,
                                        cold_counts=counts)
        return meta

    def write(self, key_cache: Tensor, value_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        store_kv(key_cache, value_cache, k, v, slot_mapping)

    def attend(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, meta: PagedMetadata,
               spec: AttentionSpec, cold: ColdBlocks | None = None) -> Tensor:
        step = self.prepare(meta).kernel_inputs
        kv_heads = key_cache.shape[2]
        out = torch.empty_like(q)  # [N, H, D]; every token is in a decode or a prefill block
        splits = step.splits or choose_splits(step.decode_blocks.shape[0], kv_heads, step.max_decode_len, q.device)
        args = (out, q, key_cache, value_cache, meta.block_tables)
        paged_attention(*args, step.decode_blocks, spec.scale, spec.sliding_window, spec.softcap, decode=True,
                        splits=splits, cold=cold)
        if step.prefill:
            blocks = step.prefill_blocks(prefill_block_tokens(q.shape[1] // kv_heads), q.device)
            paged_attention(*args, blocks, spec.scale, spec.sliding_window, spec.softcap, decode=False, cold=cold)
        return out

    def attend_cold(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, pool, layer: int,
                    meta: PagedMetadata, spec: AttentionSpec, quant: KVQuantConfig) -> Tensor:
        """attend over hot blocks and the cold pool `pool` (kv_cache.ColdPool) of an int8/int4 cache:
        cold.attend's results, the kernels reading the codes."""
        step = self.prepare(meta).kernel_inputs
        if not step.captured:
            step.split_cold(meta, quant, key_cache.shape[1])
        codes = ColdBlocks(step.cold_counts, pool.key_codes[layer], pool.key_scales[layer], pool.key_zeros[layer],
                           pool.value_codes[layer], pool.value_scales[layer], pool.value_zeros[layer], pool.bits,
                           quant.hot_tokens if step.fake else None)
        out = self.attend(q, key_cache, value_cache, meta, spec, codes)
        if step.torch_chunks:
            counts = step.cold_counts.long()
            for i in step.torch_chunks:
                start, end = meta.query_start[i], meta.query_start[i + 1]
                out[start:end] = cold.attend_chunk(q[start:end], key_cache, value_cache, pool, layer,
                                                   meta, i, counts, spec, quant)
        return out
