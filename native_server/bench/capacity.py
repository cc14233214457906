"""How many sequences a KV budget holds: paged blocks against one contiguous max-length slab per sequence.

A contiguous cache (Hugging Face's static cache, a naive server) reserves
max_position_embeddings token slots for every sequence it admits, whatever
the sequence's length; the paged cache reserves ceil(length / block_size)
blocks. `kv_capacity` is the arithmetic from the block manager's own
accounting (kv_cache.kv_bytes_per_block, num_kv_blocks); `admit_all`
demonstrates it on a real engine: it submits more prompts of that length than
fit and lets the scheduler admit as many as the block manager can hold.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

from native_server.bench.workload import random_prompts
from native_server.engine.kv_cache import kv_bytes_per_block
from py_engine.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class Capacity:
    budget_bytes: int
    bytes_per_token: int  # keys and values of every layer
    block_size: int
    seq_len: int  # tokens each sequence holds
    max_len: int  # what a contiguous cache reserves per sequence

    @property
    def blocks(self) -> int:
        return self.budget_bytes // (self.bytes_per_token * self.block_size)

    @property
    def paged_seqs(self) -> int:
        return self.blocks // -(-self.seq_len // self.block_size)

    @property
    def contiguous_seqs(self) -> int:
        return self.budget_bytes // (self.bytes_per_token * self.max_len)

    @property
    def ratio(self) -> float:
        return self.paged_seqs / self.contiguous_seqs if self.contiguous_seqs else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blocks": self.blocks, "paged_seqs": self.paged_seqs,
                "contiguous_seqs": self.contiguous_seqs, "ratio": self.ratio}


def kv_capacity(config: Any, dtype: Any, block_size: int, seq_len: int, budget_bytes: int,
                max_len: int | None = None) -> Capacity:
    """Capacity for `seq_len`-token sequences; max_len defaults to the model's max_position_embeddings."""
    per_token = kv_bytes_per_block(config, 1, dtype)
    return Capacity(budget_bytes, per_token, block_size, seq_len, max_len or config.max_position_embeddings)


def admit_all(engine: Any, seq_len: int, count: int, vocab_size: int) -> tuple[int, int]:
    """Submit `count` prompts of seq_len tokens and run one scheduling pass (no forward pass):
    returns (sequences admitted, sequences left waiting), then aborts them all.

    The engine needs max_num_seqs >= count and max_num_batched_tokens >= count * seq_len, so that
    only free KV blocks limit admission. Each prompt generates one token, so its KV never grows past
    seq_len slots.
    """
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request_ids = []
    for prompt in random_prompts(count, seq_len, vocab_size, seed=0, label="capacity"):  # no shared prefix
        request_id = f"capacity-{next(_ids)}"
        engine.add_request(request_id, prompt, params)
        request_ids.append(request_id)
    engine.scheduler.schedule()
    admitted, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
    for request_id in request_ids:
        engine.abort(request_id)
    return admitted, waiting
