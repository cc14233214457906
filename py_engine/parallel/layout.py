"""Which heads, channels and experts' channels each tensor-parallel rank holds: pure Python, no torch.

gpt-fast's layout (Megatron's): q/k/v and gate/up are column-parallel (each
rank computes some output channels), o_proj and down_proj row-parallel (each
rank reads the matching input channels and adds a partial sum, completed by
one all-reduce). Attention is split by KV head: a rank holds whole KV heads
and the query heads that read them, so grouped-query attention never needs
another rank's keys, and each rank's KV cache holds only its KV heads.

Counts that N does not divide are split as evenly as whole units allow (the
first ranks take one more): SmolLM2-135M's 3 KV heads over 2 ranks are 2 + 1,
with their 6 + 3 query heads. What cannot be split is refused at start-up
with one `TensorParallelError`: fewer KV heads than ranks (vLLM would
replicate KV heads; we do not), or channels that would cut a quantization
group in two (the row-parallel layers' groups run along their inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

MAX_TENSOR_PARALLEL = 64


class TensorParallelError(ValueError):
    """A model or option that cannot run at the tensor-parallel size asked for (raised at start-up)."""


def split_range(units: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of `units` for `rank` of `world`: contiguous, sizes differing by at most one, larger first."""
    base, extra = divmod(units, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def lcm(*values: int) -> int:
    out = 1
    for v in values:
        out = out * v // gcd(out, v)
    return out


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a decoder: [lo, hi) ranges in the model's own numbering."""

    rank: int
    world: int
    kv_heads: tuple[int, int]
    heads: tuple[int, int]  # the query heads of those KV heads
    head_dim: int
    intermediate: tuple[int, int]  # the MLP's (and each expert's) hidden channels

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    def q_rows(self) -> tuple[int, int]:
        return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim

    def kv_rows(self) -> tuple[int, int]:
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim


def check_world(world: int) -> int:
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_TENSOR_PARALLEL:
        raise TensorParallelError(f"tensor_parallel_size must be an integer in [1, {MAX_TENSOR_PARALLEL}], "
                                  f"got {world!r}")
    return world


def shard_layout(num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int, world: int, rank: int,
                 channel_unit: int = 1, o_proj_unit: int = 1) -> ShardLayout:
    """rank's layout, or TensorParallelError naming what does not split.

    channel_unit: the MLP's hidden channels are split in multiples of this (the quantization group of
    down_proj's inputs); o_proj_unit: the group of o_proj's inputs, which every head boundary between
    ranks must respect."""
    check_world(world)
    if not 0 <= rank < world:
        raise TensorParallelError(f"rank {rank} is outside [0, {world})")
    if num_kv_heads < world:
        raise TensorParallelError(
            f"tensor_parallel_size {world} is larger than the model's {num_kv_heads} KV heads "
            f"({num_heads} attention heads): each rank needs whole KV heads; use at most {num_kv_heads}")
    group = num_heads // num_kv_heads
    kv = split_range(num_kv_heads, world, rank)
    for r in range(1, world):  # every boundary between ranks, not only this rank's: all ranks must agree
        cut = split_range(num_kv_heads, world, r)[0] * group * head_dim
        if cut % o_proj_unit:
            raise TensorParallelError(
                f"tensor_parallel_size {world}: o_proj's quantization groups of {o_proj_unit} inputs cross the "
                f"boundary between ranks at input {cut} (head {cut // head_dim}); quantize with a group size "
                f"that divides {cut & -cut}")
    units = intermediate_size // channel_unit
    if units < world:
        raise TensorParallelError(
            f"tensor_parallel_size {world}: the MLP's {intermediate_size} channels hold only {units} "
            f"quantization groups of {channel_unit}, fewer than the ranks")
    lo, hi = split_range(units, world, rank)
    hi_channel = intermediate_size if hi == units else hi * channel_unit  # the last rank takes a partial group
    return ShardLayout(rank, world, kv, (kv[0] * group, kv[1] * group), head_dim,
                       (lo * channel_unit, hi_channel))
