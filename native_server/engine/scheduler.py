"""Continuous batching: which sequences compute how many tokens in the next forward pass.

Each step gives out a budget of `max_num_batched_tokens`. Running sequences
come first, in the order they were admitted, each asking for all the tokens
it has not computed yet (one for a decoding sequence, the rest of the prompt
for a prefilling one, cut to what is left of the budget: chunked prefill).
Then waiting sequences are admitted first come, first served while budget,
`max_num_seqs` and free KV blocks last; a newly admitted sequence starts
after the longest prefix the prefix cache already holds.

When a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted: its blocks are freed and it goes to
the front of the waiting queue, to be recomputed later from prompt + the
tokens it had generated (preemption by recompute: no swap space, and its
output does not change because the sampler's state lives with the request).
Pure Python.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from native_server.engine.block_manager import BlockManager
from native_server.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work, in batch order."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # aligned with seqs
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    demotions: list[tuple[int, int]] = field(default_factory=list)  # (hot, cold) to quantize, before the copies
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int, copies: list[tuple[int, int]]) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.block_copies.extend(copies)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if seq.spec_token_ids and (remaining != 1 or remaining + len(seq.spec_token_ids) > budget):
                seq.spec_token_ids = []  # drafts ride on a decode step that fits whole, or not at all
            num_new = min(remaining + len(seq.spec_token_ids), budget)
            copies = self._allocate_or_preempt(seq, num_new, out)
            if copies is None:  # seq preempted itself: nothing after it is left to run
                break
            out.add(seq, num_new, copies)
            budget -= num_new
            i += 1
        if not out.preempted:  # admitting while evicting would only thrash
            self._admit(budget, out)
        out.demotions = self.block_manager.take_demotions()
        return out

    def _allocate_or_preempt(self, seq: Sequence, num_new: int,
                             out: SchedulerOutput) -> list[tuple[int, int]] | None:
        while True:
            copies = self.block_manager.allocate(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is not None:
                return copies
            # The last admitted is the lowest priority; it is never one already scheduled this step.
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # A request with n samples not yet forked will soon take n places.
            slots = seq.params.n if seq.index == 0 and not seq.output_token_ids else 1
            if len(self.running) + slots > self.max_num_seqs:
                break
            caching = bm.enable_prefix_caching
            cached = bm.cached_prefix(seq.full_block_hashes(self.block_size), seq.num_tokens) if caching else []
            num_computed = len(cached) * self.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            copies = bm.allocate(seq.seq_id, num_computed, num_new, cached)
            if copies is None:  # wait for blocks; FCFS: nobody behind it jumps the queue
                break
            self.waiting.popleft()
            if caching:
                bm.record_prefix_lookup(seq.num_tokens, num_computed)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.add(seq, num_new, copies)
            budget -= num_new

    def update(self, out: SchedulerOutput, new_token_ids: dict[int, int | list[int]]) -> None:
        """After the forward: advance each scheduled sequence and append its sampled tokens (by seq_id: one, or
        with speculative drafts the ones the verify pass kept and the target's own token after them)."""
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            tokens = new_token_ids.get(seq.seq_id, ())
            tokens = [tokens] if isinstance(tokens, int) else tokens
            drafts = len(seq.spec_token_ids)
            if drafts:  # the rejected drafts' positions were computed for nothing: not part of the sequence
                num_new -= drafts - (len(tokens) - 1)
                seq.spec_token_ids = []
            seq.num_computed_tokens += num_new
            seq.output_token_ids.extend(tokens)
            if drafts:
                self.block_manager.trim(seq.seq_id, seq.num_tokens)
            self._cache(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run child (a sample of parent's request) on parent's blocks; call after update()."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_hashes = list(parent.block_hashes[:parent.num_prompt_tokens // self.block_size])
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Stop seq (stopped, length or aborted) and free its blocks."""
        assert status.is_finished
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.status.is_finished:
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq.seq_id)

    def _cache(self, seq: Sequence) -> None:
        if self.block_manager.enable_prefix_caching:
            hashes = seq.full_block_hashes(self.block_size)
            self.block_manager.cache_blocks(seq.seq_id, hashes, seq.num_computed_tokens)
