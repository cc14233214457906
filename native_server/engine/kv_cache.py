"""The paged KV cache: per-layer block tensors, their size from a memory budget, and the model-facing view.

The model calls `kv.attend(layer, q, k, v, positions, spec)` (py_engine's
KVCache protocol) on a flattened batch: B = 1 and T = every token scheduled
this step, across all sequences. `PagedKVCache.step(meta)` returns the object
the model gets: it carries the step's metadata (which slot each token writes,
each sequence's block table and context length), so the cache stays an
argument, never a global.

With int8/int4 KV (py_engine/models/kv_quant.py) a `ColdPool` sits beside
the hot blocks: per layer, codes [blocks, block_size, kv_heads, head_dim *
bits / 8] and float32 scales and zero points beside them (keys: one per
channel of a block; values: one per token). `demote` quantizes hot blocks
into it, once, when the scheduler says they left the hot window; each
backend's `attend_cold` reads them (the CPU's and Triton's in their kernels,
the torch reference through attention/cold.py).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from native_server.engine.attention import PagedAttentionBackend, PagedMetadata, backend_for
from py_engine.config import ModelConfig
from py_engine.kernels.paged import PagedStepView
from py_engine.models.attention import AttentionSpec
from py_engine.models.kv_quant import KVQuantConfig, dequantize, pack, quantize, unpack

if TYPE_CHECKING:
    from native_server.engine.config import EngineConfig

logger = logging.getLogger("ruvllm.server")

DEFAULT_CPU_KV_BYTES = 1 << 30  # when kv_cache_memory is not given; capped at what max_num_seqs could fill


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """Keys and values of every layer (`layers`, the model's by default) for block_size tokens."""
    per_token = 2 * (layers or config.num_hidden_layers) * config.num_key_value_heads * config.head_dim
    return per_token * block_size * dtype.itemsize


def cold_bytes_per_block(config: ModelConfig, quant: KVQuantConfig) -> int:
    """Codes, scales and zero points of every layer for one cold block."""
    per_token = quant.cold_bytes_per_token(config.num_key_value_heads, config.head_dim)
    return int(config.num_hidden_layers * per_token * quant.block_size)


def split_budget(config: ModelConfig, quant: KVQuantConfig, dtype: torch.dtype, budget: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(hot blocks, cold blocks) of a two-tier cache in `budget` bytes.

    A running sequence holds at most hot_tokens / block_size + 2 hot blocks
    (its window, the block being filled, the one about to turn cold), and
    one step's new tokens are written hot before they are demoted at the
    sequence's next step. The hot pool gets that for max_num_seqs sequences
    plus one step, but no more than the hot share of sequences of
    max_model_len tokens (hot blocks in the proportion such a sequence holds
    them): more would only sit idle. The rest buys cold blocks.
    """
    bs = quant.block_size
    hot_block, cold_block = kv_bytes_per_block(config, bs, dtype), cold_bytes_per_block(config, quant)
    per_seq_hot, per_seq_cold, step_blocks = _two_tier_blocks(quant, max_num_batched_tokens, max_model_len)
    share = per_seq_hot * hot_block / (per_seq_hot * hot_block + per_seq_cold * cold_block)
    fair = int(share * max(budget - step_blocks * hot_block, 0)) // hot_block + step_blocks
    hot = min(max_num_seqs * per_seq_hot + step_blocks, max(fair, per_seq_hot + step_blocks), budget // hot_block)
    return hot, (budget - hot * hot_block) // cold_block


def _two_tier_blocks(quant: KVQuantConfig, max_num_batched_tokens: int, max_model_len: int) -> tuple[int, int, int]:
    """(hot blocks a running sequence holds at most, cold blocks of a max_model_len sequence, hot blocks of
    one step's new tokens)."""
    bs = quant.block_size
    return (-(-quant.hot_tokens // bs) + 2, -(-max(max_model_len - quant.hot_tokens, 0) // bs),
            -(-min(max_num_batched_tokens, max_model_len) // bs))


def two_tier_bytes(config: ModelConfig, quant: KVQuantConfig, dtype: torch.dtype, num_seqs: int,
                   max_num_batched_tokens: int, max_model_len: int) -> int:
    """Bytes num_seqs sequences of max_model_len tokens take in a two-tier cache, one step's tokens included."""
    hot, cold, step = _two_tier_blocks(quant, max_num_batched_tokens, max_model_len)
    return (num_seqs * hot + step) * kv_bytes_per_block(config, quant.block_size, dtype) + (
        num_seqs * cold * cold_bytes_per_block(config, quant))


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


def allocate_kv_cache(config: "EngineConfig", model_config: ModelConfig, model: torch.nn.Module,
                      device: torch.device, max_model_len: int, max_num_batched_tokens: int,
                      backend: PagedAttentionBackend, quant: KVQuantConfig,
                      kv_layers: int | None = None) -> "PagedKVCache":
    """The engine's paged cache, sized from its memory budget (memory_budget), its blocks in the cache's dtype.

    On the CPU without kv_cache_memory the budget stops at what max_num_seqs sequences of max_model_len tokens
    could fill. With int8 / int4 the budget is split into hot and cold blocks (split_budget). Raises ValueError
    when not even one sequence of max_model_len tokens fits."""
    block_size, max_num_seqs = config.block_size, config.max_num_seqs
    dtype = quant.storage(next(model.parameters()).dtype)  # the (hot) blocks': fp16 / bf16, or the model's
    reserve = activation_reserve(model_config, max_num_batched_tokens, max_num_seqs)
    budget = memory_budget(device, config.kv_cache_memory, config.gpu_memory_fraction, reserve)
    # On CPU without a budget, stop at what max_num_seqs full-length sequences could fill.
    cap = -(-max_num_seqs * max_model_len // block_size) if (
        config.kv_cache_memory is None and device.type == "cpu") else None
    if quant.enabled:
        if cap is not None:  # the same cap: what max_num_seqs full-length sequences could fill
            budget = min(budget, two_tier_bytes(model_config, quant, dtype, max_num_seqs, max_num_batched_tokens,
                                                max_model_len))
        hot, cold = split_budget(model_config, quant, dtype, max(budget, 0), max_num_seqs, max_num_batched_tokens,
                                 max_model_len)
        # One max_model_len sequence must fit: hot its window and one step's tokens, cold the rest.
        need_hot, need_cold, step = _two_tier_blocks(quant, max_num_batched_tokens, max_model_len)
        if hot < need_hot + step or cold < need_cold:
            raise ValueError(f"the KV cache budget holds {hot} hot and {cold} cold blocks of {block_size} "
                             f"tokens, too few for one sequence of max_model_len {max_model_len}: give it "
                             f"more memory or lower max_model_len")
        return PagedKVCache(model_config, hot, block_size, dtype, device, backend, quant=quant, num_cold_blocks=cold)
    num_blocks = num_kv_blocks(model_config, block_size, dtype, max(budget, 0), cap, kv_layers)
    if config.kv_cache_memory is None and device.type == "cpu":
        logger.info("KV cache: %d MiB by default on the CPU (at most 1 GiB, or what --max-concurrent sequences "
                    "of the full context fill); --kv-cache-memory sets it, --kv-cache-dtype fp16 or int8 fits "
                    "more tokens in it", num_blocks * kv_bytes_per_block(model_config, block_size, dtype, kv_layers)
                    >> 20)
    if num_blocks * block_size < max_model_len:
        raise ValueError(f"the KV cache budget holds {max(num_blocks, 0) * block_size} tokens, fewer than "
                         f"max_model_len {max_model_len}: give it more memory or lower max_model_len")
    return PagedKVCache(model_config, num_blocks, block_size, dtype, device, backend, kv_layers)


class ColdPool:
    """Quantized blocks of every layer: keys per channel, values per token (kv_quant.py)."""

    def __init__(self, config: ModelConfig, num_blocks: int, quant: KVQuantConfig, device: torch.device | str) -> None:
        shape = (num_blocks, quant.block_size, config.num_key_value_heads)
        D, layers = config.head_dim, range(config.num_hidden_layers)
        codes = (*shape, D * quant.bits // 8)
        zeros = lambda *s, dtype=torch.float32: [torch.zeros(s, dtype=dtype, device=device) for _ in layers]  # noqa: E731
        self.key_codes, self.value_codes = zeros(*codes, dtype=torch.uint8), zeros(*codes, dtype=torch.uint8)
        self.key_scales, self.key_zeros = zeros(num_blocks, 1, shape[2], D), zeros(num_blocks, 1, shape[2], D)
        self.value_scales, self.value_zeros = zeros(*shape, 1), zeros(*shape, 1)
        self.num_blocks, self.bits = num_blocks, quant.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key_codes, *self.value_codes, *self.key_scales,
                                                          *self.key_zeros, *self.value_scales, *self.value_zeros))

    def store(self, layer: int, ids: Tensor, keys: Tensor, values: Tensor) -> None:
        """Quantize keys, values [n, block_size, KV, D] into cold blocks ids [n]."""
        codes, scale, zero = quantize(keys, 1, self.bits)  # per channel: over the block's tokens
        self.key_codes[layer][ids], self.key_scales[layer][ids], self.key_zeros[layer][ids] = (
            pack(codes, self.bits), scale, zero)
        codes, scale, zero = quantize(values, -1, self.bits)  # per token: over the head's channels
        self.value_codes[layer][ids], self.value_scales[layer][ids], self.value_zeros[layer][ids] = (
            pack(codes, self.bits), scale, zero)

    def blocks(self, layer: int, ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Dequantized keys and values [n, block_size, KV, D] of cold blocks ids [n]."""
        keys = dequantize(unpack(self.key_codes[layer][ids], self.bits), self.key_scales[layer][ids],
                          self.key_zeros[layer][ids], dtype)
        values = dequantize(unpack(self.value_codes[layer][ids], self.bits), self.value_scales[layer][ids],
                            self.value_zeros[layer][ids], dtype)
        return keys, values


class PagedKVCache:
    """Per layer, keys and values [num_blocks, block_size, kv_heads, head_dim] (layout: attention/interface.py)
    of `dtype` (the model's, or fp16 / bf16 with --kv-cache-dtype), and with int8/int4 KV a ColdPool of
    num_cold_blocks. The torch and Triton backends widen the blocks to the queries' dtype as they read; the
    C decode reads them into fp32, so fp16 blocks under a bf16 model are rounded to bf16 in prompt chunks only
    (one bf16 ulp; fp16 also saves nothing there: bf16 has the same 2 bytes and no overflow above 65504)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, backend: PagedAttentionBackend | None = None,
                 layers: int | None = None, quant: KVQuantConfig | None = None, num_cold_blocks: int = 0) -> None:
        """layers: how many to hold, the model's by default (X-LoRA's scaling pass has its own: 2 x)."""
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        n = layers or config.num_hidden_layers
        # Zeros, not empty: padded attention reads unwritten slots, and 0 * NaN garbage would be NaN.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.backend = backend or backend_for(device)
        self.quant = quant if quant is not None and quant.enabled else None
        self.cold = ColdPool(config, num_cold_blocks, self.quant, device) if self.quant else None
        self.hot_bytes_per_token = kv_bytes_per_block(config, block_size, dtype) / block_size
        self.cold_bytes_per_token = cold_bytes_per_block(config, self.quant) / block_size if self.quant else 0.0
        mib = 2 * len(self.keys) * self.keys[0].numel() * dtype.itemsize / 2**20
        if self.cold is None:
            logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB of %s) on %s, %s attention",
                        num_blocks, block_size, num_blocks * block_size, mib, str(dtype).removeprefix("torch."),
                        device, self.backend.name)
            return
        logger.info("KV cache: %s, %d hot tokens: %d hot blocks of %d tokens (%.0f bytes/token, %.1f MiB) + %d "
                    "cold blocks (%.0f bytes/token, %.1f MiB) = %d tokens on %s, %s attention%s", self.quant.dtype,
                    self.quant.hot_tokens, num_blocks, block_size,
                    self.hot_bytes_per_token, mib, num_cold_blocks, self.cold_bytes_per_token,
                    self.cold.nbytes / 2**20, (num_blocks + num_cold_blocks) * block_size, device, self.backend.name,
                    " (cold blocks: torch)" if self.backend.name == "torch" else "")

    @property
    def num_cold_blocks(self) -> int:
        return self.cold.num_blocks if self.cold is not None else 0

    def demote(self, moves: list[tuple[int, int]]) -> None:
        """Quantize hot blocks into cold ones, (hot id, cold id) in order (a later move to the same cold
        block wins), in every layer."""
        if not moves:
            return
        last = dict((cold, hot) for hot, cold in moves)
        device = self.keys[0].device
        hot = torch.tensor(list(last.values()), device=device)
        cold = torch.tensor(list(last.keys()), device=device)
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            self.cold.store(layer, cold, keys[hot], values[hot])

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
        return PagedKVStep(self, self.backend.prepare(meta), self._two_tier(meta))

    def _two_tier(self, meta: PagedMetadata) -> bool:
        """Whether some query of the step reads a block cold (else the backend's own path, bit for bit)."""
        if self.quant is None:
            return False
        if getattr(meta.kernel_inputs, "captured", False):  # a CUDA graph: cold counts are device inputs
            return True
        if meta.cold_blocks is None:
            return False
        if any(meta.cold_blocks):
            return True
        top = [meta.context_lens[i] - 1 for i in meta.prefill_seqs]  # the last query of each chunk
        return any(self.quant.cold_edge(p) > 0 for p in top)


class PagedKVStep:
    """The cache as the model sees it for one step of a flattened batch (py_engine's KVCache protocol)."""

    def __init__(self, cache: PagedKVCache, meta: PagedMetadata, two_tier: bool = False) -> None:
        self.cache, self.meta, self.two_tier = cache, meta, two_tier

    def decode_view(self) -> PagedStepView | None:
        """The step as the CPU's one-call decode stack runs it (py_engine/cpu/stack.py): only a step of one
        sequence decoding one token, with the C attention backend; None otherwise (the model's own path)."""
        cache, meta = self.cache, self.meta
        if cache.backend.name != "cpu" or len(meta.context_lens) != 1 or meta.prefill_seqs:
            return None
        length = meta.context_lens[0]
        table = meta.block_tables[0, :-(-length // cache.block_size)]  # [blocks], a contiguous row
        cold = cache.cold
        codes = None if cold is None else list(zip(cold.key_codes, cold.value_codes, cold.key_scales, cold.key_zeros,
                                                   cold.value_scales, cold.value_zeros))
        return PagedStepView(cache.keys, cache.values, codes, cold.bits if cold is not None else 0, table, length,
                             meta.cold_blocks[0] if meta.cold_blocks else 0, int(meta.slot_mapping[0]))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               spec: AttentionSpec) -> Tensor:
        """q [1, H, N, D], k and v [1, KV, N, D] -> [1, H, N, D]."""
        cache = self.cache
        key_cache, value_cache = cache.keys[layer], cache.values[layer]
        cache.backend.write(key_cache, value_cache, k[0].transpose(0, 1), v[0].transpose(0, 1),
                            self.meta.slot_mapping)  # [N, KV, D] each
        q = q[0].transpose(0, 1)  # [N, H, D]
        if self.two_tier:  # some block is cold: the backend reads both pools (cold.py's torch path for "torch")
            out = cache.backend.attend_cold(q, key_cache, value_cache, cache.cold, layer, self.meta, spec, cache.quant)
        else:
            out = cache.backend.attend(q, key_cache, value_cache, self.meta, spec)  # [N, H, D]
        return out.transpose(0, 1)[None]
