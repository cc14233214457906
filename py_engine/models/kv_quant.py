"""The two-tier KV cache's arithmetic: which tokens are cold, and KIVI-style int8/int4 blocks.

A sequence's most recent `hot_tokens` tokens keep the model's dtype; older
tokens, a whole block of `block_size` at a time, are stored quantized
(KIVI, Liu et al. 2024): keys per channel (one scale and zero point per
(head, channel) over the block's tokens, since keys have outlier channels),
values per token (one per (token, head) over the head's channels),
asymmetric, unsigned codes of 8 or 4 bits:

    scale = (max - min) / (2**bits - 1);  code = round((x - min) / scale);  x' = code * scale + min

The rule every cache follows (dense, paged, CPU, GPU) is per query, so a
result never depends on how the work was cut into calls (a whole prompt, a
prefill chunk, a decode step): a query at position p reads the tokens of
every block that ends at or before p + 1 - hot_tokens dequantized, and the
rest as they are. That is what decoding token by token would see, so
perplexity over a window in one call measures what generation gets. A
block turns cold once, for good: the caches quantize it as soon as no later
query can read it hot. While p + 1 - hot_tokens < block_size nothing is cold
and the arithmetic is the full-precision cache's, bit for bit.

Quantization runs in float32 with one expression (`quantize`,
`dequantize`) shared by every layout, so a block quantized on the fly and
the same block read back from a cold pool give the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# The server's paged cache takes them all; the dense cache (LLM, generate, chat, eval ppl) DENSE_KV_CACHE_DTYPES.
KV_CACHE_DTYPES = ("auto", "fp16", "bf16", "int8", "int4")
DENSE_KV_CACHE_DTYPES = ("auto", "int8", "int4")
FLOAT_KV_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_HOT_TOKENS = 128


@dataclass(frozen=True)
class KVQuantConfig:
    """The KV cache's storage: "auto" (the model's dtype throughout), "fp16" or "bf16" (every block in 16 bits,
    whatever the model's dtype: the server's paged cache only), "int8" or "int4" cold blocks (the hot window
    in the model's dtype).

    One value, as vLLM's --kv-cache-dtype: fp16 and int8/int4 do not combine. The two-tier cache's hot window
    is a small share of its bytes (kv_hot_tokens per sequence), so a 16-bit one would save little, and keeping
    it in the model's dtype keeps the tiers' arithmetic (native_server/engine/attention/cold.py, the Triton and C cold paths)
    bit for bit the dense two-tier cache's."""

    dtype: str = "auto"
    hot_tokens: int = DEFAULT_HOT_TOKENS  # 0 is allowed here for the no-hot-tail ablation; check() refuses it
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.hot_tokens < 0 or self.block_size < 1:
            raise ValueError(f"need kv_hot_tokens >= 0 and block_size >= 1, got {self.hot_tokens}, "
                             f"{self.block_size}")

    @property
    def enabled(self) -> bool:
        """A two-tier cache (int8/int4 cold blocks)."""
        return self.dtype in ("int8", "int4")

    def storage(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the (hot) blocks: fp16/bf16 as asked, else the model's."""
        return FLOAT_KV_DTYPES.get(self.dtype, model_dtype)

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4}[self.dtype]

    def check(self, max_context: int) -> "KVQuantConfig":
        """The bounds a user's settings must meet (start-up errors): one block <= hot tokens <= context."""
        if self.enabled and not self.block_size <= self.hot_tokens <= max_context:
            raise ValueError(f"kv_hot_tokens is {self.hot_tokens} but must be at least one block "
                             f"({self.block_size} tokens) and at most the context ({max_context} tokens)")
        return self

    def cold_edge(self, position: int) -> int:
        """Tokens a query at `position` reads dequantized: those before the returned position (a block edge)."""
        if not self.enabled:
            return 0
        return max(0, (position + 1 - self.hot_tokens) // self.block_size * self.block_size)

    def cold_edges(self, positions: Tensor) -> Tensor:
        """cold_edge of each position of a long tensor."""
        return ((positions + 1 - self.hot_tokens).clamp(min=0) // self.block_size) * self.block_size

    def cold_bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """Bytes one token of one layer takes in a cold block: codes, plus the scales and zero points
        (float32) of its keys' channels (shared by the block's tokens) and of its own values."""
        codes = 2 * kv_heads * head_dim * self.bits / 8
        return codes + 8 * kv_heads * head_dim / self.block_size + 8 * kv_heads


def dense_kv_config(dtype: str, hot_tokens: int = DEFAULT_HOT_TOKENS) -> KVQuantConfig:
    """KVQuantConfig for a dense cache (LLM, generate, chat, eval ppl): its dtypes keep the model's dtype or
    int8/int4 cold blocks; fp16 / bf16 are refused with a message naming the server, which stores them."""
    if dtype in FLOAT_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {dtype!r} is the server's paged cache (ruvllm serve); the dense cache "
                         f"takes {', '.join(DENSE_KV_CACHE_DTYPES)}")
    if dtype not in DENSE_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {dtype!r} is not one of {', '.join(DENSE_KV_CACHE_DTYPES)}")
    return KVQuantConfig(dtype, hot_tokens)


def quantize(x: Tensor, dim: int, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric quantization of x over `dim`: (codes uint8, unpacked; scale; zero), scale and zero
    float32 with `dim` kept as 1. A constant group gets scale 1 and dequantizes to itself."""
    x = x.float()
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (high - low) / (2**bits - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - low) / scale).clamp_(0, 2**bits - 1).to(torch.uint8)
    return codes, scale, low


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype) -> Tensor:
    return (codes.float() * scale + zero).to(dtype)


def pack(codes: Tensor, bits: int) -> Tensor:
    """int4: two codes a byte along the last dim (even index in the low nibble); int8 as it is."""
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: Tensor, bits: int) -> Tensor:
    if bits == 8:
        return packed
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # [..., D / 2, 2] -> [..., D]


def fake_quantize_blocks(keys: Tensor, values: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Keys and values [..., blocks, block_size, D] as a cold pool would give them back (same dtype)."""
    k = dequantize(*quantize(keys, -2, bits), keys.dtype)  # per channel: over the block's tokens
    v = dequantize(*quantize(values, -1, bits), values.dtype)  # per token: over the head's channels
    return k, v


def add_kv_cache_options(parser, paged: bool = False) -> None:
    """--kv-cache-dtype and --kv-hot-tokens, shared by serve and benchmark (paged: the server's cache, which also
    takes fp16 / bf16) and by generate, chat and eval ppl (the dense cache)."""
    choices = KV_CACHE_DTYPES if paged else DENSE_KV_CACHE_DTYPES
    parser.add_argument("--kv-cache-dtype", default="auto", choices=choices,
                        help="KV cache storage: auto (the model's dtype)"
                             + ("; fp16 or bf16 (every block 16-bit: half an fp32 model's cache, as llama.cpp's "
                                "default f16 cache)" if paged else "")
                             + "; or int8 / int4 blocks once they leave the hot window (keys per channel, values "
                               "per token, as KIVI; the window keeps the model's dtype)")
    parser.add_argument("--kv-hot-tokens", type=int, default=DEFAULT_HOT_TOKENS, metavar="N",
                        help=f"most recent tokens kept in the model's dtype with int8/int4 KV (default "
                             f"{DEFAULT_HOT_TOKENS}; at least one block, at most the context)")
