"""The paged KV cache: per-layer block tensors, their size from a memory budget, and the model-facing view.

The model calls `kv.attend(layer, q, k, v, positions, spec)` (py_engine's
KVCache protocol) on a flattened batch: B = 1 and T = every token scheduled
this step, across all sequences. `PagedKVCache.step(meta)` returns the object
the model gets: it carries the step's metadata (which slot each token writes,
each sequence's block table and context length), so the cache stays an
argument, never a global.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from native_server.paged_attention import PagedAttentionBackend, PagedMetadata, backend_for
from py_engine.config import ModelConfig
from py_engine.models.attention import AttentionSpec

logger = logging.getLogger("ruvllm.server")

DEFAULT_CPU_KV_BYTES = 1 << 30  # when kv_cache_memory is not given; capped at what max_num_seqs could fill


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """Keys and values of every layer (`layers`, the model's by default) for block_size tokens."""
    per_token = 2 * (layers or config.num_hidden_layers) * config.num_key_value_heads * config.head_dim
    return per_token * block_size * dtype.itemsize


def activation_reserve(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A rough upper bound of one forward's float32 temporaries, kept out of the KV budget on GPUs.

    (vLLM profiles a dummy forward pass instead; this estimate errs large.)
    """
    per_token = 4 * config.hidden_size + 3 * config.intermediate_size
    return 4 * (max_num_batched_tokens * per_token + 3 * max_num_seqs * config.vocab_size)


def memory_budget(device: torch.device, kv_cache_memory: int | None, gpu_memory_fraction: float,
                  reserve: int) -> int:
    """Bytes the KV cache may take: kv_cache_memory if given; on CUDA and MPS, gpu_memory_fraction of
    the device's memory less what is already in use (the weights), less `reserve`."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * gpu_memory_fraction) - (total - free) - reserve
    if device.type == "mps":
        total = torch.mps.recommended_max_memory()
        return int(total * gpu_memory_fraction) - torch.mps.driver_allocated_memory() - reserve
    return DEFAULT_CPU_KV_BYTES


def num_kv_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, budget: int,
                  max_blocks: int | None = None, layers: int | None = None) -> int:
    """How many blocks fit the budget (at most max_blocks)."""
    blocks = budget // kv_bytes_per_block(config, block_size, dtype, layers)
    return blocks if max_blocks is None else min(blocks, max_blocks)


class PagedKVCache:
    """Per layer, keys and values [num_blocks, block_size, kv_heads, head_dim] (layout: paged_attention.py)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, backend: PagedAttentionBackend | None = None,
                 layers: int | None = None) -> None:
        """layers: how many to hold, the model's by default (X-LoRA's scaling pass has its own: 2 x)."""
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        n = layers or config.num_hidden_layers
        # Zeros, not empty: padded attention reads unwritten slots, and 0 * NaN garbage would be NaN.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.backend = backend or backend_for(device)
        mib = 2 * len(self.keys) * self.keys[0].numel() * dtype.itemsize / 2**20
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB) on %s, %s attention",
                    num_blocks, block_size, num_blocks * block_size, mib, device, self.backend.name)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's contents into block dst, in every layer."""
        if not copies:
            return
        device = self.keys[0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for cache in self.keys + self.values:
            cache[dst] = cache[src]

    def step(self, meta: PagedMetadata) -> PagedKVStep:
        return PagedKVStep(self, self.backend.prepare(meta))


class PagedKVStep:
    """The cache as the model sees it for one step of a flattened batch (py_engine's KVCache protocol)."""

    def __init__(self, cache: PagedKVCache, meta: PagedMetadata) -> None:
        self.cache, self.meta = cache, meta

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               spec: AttentionSpec) -> Tensor:
        """q [1, H, N, D], k and v [1, KV, N, D] -> [1, H, N, D]."""
        cache = self.cache
        key_cache, value_cache = cache.keys[layer], cache.values[layer]
        cache.backend.write(key_cache, value_cache, k[0].transpose(0, 1), v[0].transpose(0, 1),
                            self.meta.slot_mapping)  # [N, KV, D] each
        out = cache.backend.attend(q[0].transpose(0, 1), key_cache, value_cache, self.meta, spec)  # [N, H, D]
        return out.transpose(0, 1)[None]
