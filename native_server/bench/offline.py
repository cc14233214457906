"""The engine benchmarked in this process: requests submitted straight to an `LLMEngine`, no HTTP.

A run keeps `concurrency` requests in flight (a new one is added as one
finishes) and times each from `add_request` to the step that returned each
of its tokens. After every step it also records how full the KV blocks in
use are (`kv_occupancy`): the slots holding a computed token over the slots
of every block some sequence holds, the paged cache's internal waste.
"""
from __future__ import annotations

import itertools
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from native_server.bench.stats import RequestTiming
from py_engine.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class KVOccupancy:
    """One instant of the KV cache, in token slots."""

    running: int  # sequences running
    tokens_held: int  # slots holding a computed token (a block shared by sequences counts once)
    slots_reserved: int  # slots of the blocks held by some sequence
    slots_total: int  # slots of the whole pool

    @property
    def utilization(self) -> float:
        """Tokens held / slots reserved: 1.0 means no block holds an empty slot."""
        return self.tokens_held / self.slots_reserved if self.slots_reserved else float("nan")


def kv_occupancy(engine: Any) -> KVOccupancy:
    """Read the block manager between steps: each running sequence's table and computed tokens."""
    bm = engine.block_manager
    size = bm.block_size
    filled: dict[tuple[bool, int], int] = {}  # (cold pool?, block id) -> slots with a computed token
    for seq in engine.scheduler.running:
        cold = bm.num_cold(seq.seq_id)  # a two-tier cache's tables start with ids of its cold pool
        for i, block in enumerate(bm.block_table(seq.seq_id)):
            slots = min(size, max(seq.num_computed_tokens - i * size, 0))
            filled[i < cold, block] = max(filled.get((i < cold, block), 0), slots)
    return KVOccupancy(len(engine.scheduler.running), sum(filled.values()),
                       (bm.num_used_blocks + bm.num_used_cold_blocks) * size, (bm.num_blocks + bm.num_cold_blocks) * size)


def peak_rss_mib() -> float:
    """This process's peak resident set so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def run_engine(engine: Any, prompts: Sequence[list[int]], gen_len: int, concurrency: int,
               occupancy: list[KVOccupancy] | None = None, lora: str | None = None) -> list[RequestTiming]:
    """Run every prompt (greedy, ignoring EOS, gen_len tokens each), at most `concurrency` at a time;
    lora: the engine's LoRA adapter every request runs with (None: the base model)."""
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    pending = deque(prompts)
    timings: dict[str, RequestTiming] = {}
    active = 0

    def submit() -> None:
        nonlocal active
        ids = pending.popleft()
        request_id = f"bench-{next(_ids)}"
        timings[request_id] = RequestTiming(time.perf_counter(), len(ids))
        engine.add_request(request_id, ids, params, *(() if lora is None else (lora,)))
        active += 1

    while pending and active < concurrency:
        submit()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        if occupancy is not None:
            occupancy.append(kv_occupancy(engine))
        for out in outputs:
            count = sum(len(o.token_ids) for o in out.outputs)
            if count:
                timings[out.request_id].chunk(now, count)
            if out.finished:
                active -= 1
                if pending:
                    submit()
    return list(timings.values())


def occupancy_at_peak(samples: Sequence[KVOccupancy]) -> KVOccupancy | None:
    """The steps with the most sequences running, pooled: their tokens held and slots reserved summed.

    Pooled rather than one instant, because the last block of each sequence
    fills up and empties every block_size steps: one instant would pick a phase.
    """
    if not samples:
        return None
    most = max(s.running for s in samples)
    peak = [s for s in samples if s.running == most]
    return KVOccupancy(most, sum(s.tokens_held for s in peak), sum(s.slots_reserved for s in peak),
                       sum(s.slots_total for s in peak))
