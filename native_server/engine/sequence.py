"""One sequence the scheduler runs: a prompt, its generated tokens, and how far the KV cache has caught up.

There is no prefill or decode phase: `num_computed_tokens` (tokens whose KV is
in the cache) catches up with `num_tokens` (prompt + generated). A new prompt,
a chunk of a long prompt, one decode step, and the recompute of a preempted
sequence are all "compute the next tokens up to num_tokens". A request with
n samples runs as n sequences. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from native_server.engine.block_manager import BlockHash, adapter_root, extend_block_hashes
from py_engine.sampling_params import SamplingParams


class SequenceStatus(IntEnum):
    """Live states first: every finished state compares greater than PREEMPTED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its KV freed; it recomputes when resumed
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)

    @classmethod
    def finished_by(cls, reason: str) -> SequenceStatus:
        return {"stop": cls.FINISHED_STOPPED, "length": cls.FINISHED_LENGTH, "abort": cls.FINISHED_ABORTED}[reason]


_FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                   SequenceStatus.FINISHED_ABORTED: "abort"}


@dataclass(eq=False)
class Sequence:
    seq_id: int  # unique in the engine; request ids are the client's and may repeat across time
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]  # shared by the n samples; never mutated
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int | None = None  # prompt tokens from the prefix cache, set when first admitted
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the full blocks known so far
    lora: str | None = None  # the LoRA adapter it runs with (its key in the model's LoraManager), None: base
    lora_load_id: int | None = None  # unique per adapter load: roots its prefix-cache chain (adapter_root)
    # Speculative decoding: drafts proposed for this step, computed after the pending token as if they were
    # tokens of the sequence; the verify pass keeps a prefix of them (speculative.py), never num_tokens' own
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (+ this step's drafts past num_tokens), without concatenating
        the whole sequence."""
        n = self.num_tokens
        if end > n:
            return self.token_ids(start, n) + self.spec_token_ids[max(start - n, 0):end - n]
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def full_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of every full block of the sequence so far (extended lazily, each block hashed once)."""
        hashed = len(self.block_hashes) * block_size
        num_full = self.num_tokens // block_size * block_size
        if hashed < num_full:
            extend_block_hashes(self.block_hashes, self.token_ids(hashed, num_full), block_size,
                                adapter_root(self.lora_load_id))
        return self.block_hashes
