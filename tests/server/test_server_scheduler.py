"""Scheduler unit tests (no model): token budget, chunked prefill, FCFS, max_num_seqs, preemption, prefix hits."""
from __future__ import annotations

from native_server.engine.block_manager import BlockManager
from native_server.engine.scheduler import Scheduler, SchedulerOutput
from native_server.engine.sequence import Sequence, SequenceStatus
from py_engine.sampling_params import SamplingParams


def make_seq(seq_id: int, prompt_len: int, first: int = 0) -> Sequence:
    prompt = list(range(first, first + prompt_len))
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, SamplingParams.greedy())


def run_step(sched: Scheduler) -> SchedulerOutput:
    """Schedule, then 'sample' token 1000 + seq_id for every sequence that caught up."""
    out = sched.schedule()
    sampled = {s.seq_id: 1000 + s.seq_id for s, n in zip(out.seqs, out.num_new_tokens)
               if s.num_computed_tokens + n == s.num_tokens}
    sched.update(out, sampled)
    return out


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq_id, n) for s, n in zip(out.seqs, out.num_new_tokens)]


def test_prefill_chunks_and_decode_share_one_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a, b = make_seq(1, 10), make_seq(2, 5, first=50)
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [(1, 8)]  # a's prompt is cut to the budget
    assert a.output_token_ids == [] and a.num_computed_tokens == 8
    assert plan(run_step(sched)) == [(1, 2), (2, 5)]  # a finishes its prompt and samples; b starts
    assert a.output_token_ids == [1001] and b.output_token_ids == [1002]
    assert plan(run_step(sched)) == [(1, 1), (2, 1)]  # both decode
    assert a.num_computed_tokens == 11 and a.num_tokens == 12


def test_max_num_seqs_and_fcfs():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(i, 3, first=10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    assert plan(run_step(sched)) == [(0, 3), (1, 3)]
    sched.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    assert plan(run_step(sched)) == [(1, 1), (2, 3)]
    assert [s.seq_id for s in sched.waiting] == [3]


def test_admission_waits_for_blocks_without_preempting():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make_seq(1, 12))
    sched.add(make_seq(2, 8, first=20))
    out = run_step(sched)
    assert plan(out) == [(1, 12)] and not out.preempted
    assert [s.seq_id for s in sched.waiting] == [2]


def test_preemption_frees_the_latest_admitted_and_recomputes_it():
    bm = BlockManager(5, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(1, 8), make_seq(2, 7, first=40)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: blocks 0, 1 (8 tokens); b: blocks 2, 3 (7 tokens)
    assert (bm.block_table(1), bm.block_table(2)) == ([0, 1], [2, 3])
    run_step(sched)  # a needs block 4 for token 8; b writes token 7 into its block 3
    out = run_step(sched)  # a: token 9 fits block 4; b needs a fifth block: none left -> b preempts itself
    assert [s.seq_id for s in out.preempted] == [2] and plan(out) == [(1, 1)]
    assert b.status == SequenceStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and bm.block_table(2) == []
    assert sched.num_preemptions == 1
    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    out = run_step(sched)
    # b resumes: both its full blocks (computed before it was preempted) come back from the
    # prefix cache; only its last generated token is recomputed. num_cached_tokens keeps
    # what the prompt got from the cache when b was first admitted.
    assert plan(out) == [(2, 1)] and b.num_cached_tokens == 0
    assert bm.block_table(2) == [2, 3, 4] and b.output_token_ids == [1002, 1002, 1002]
    assert (bm.prefix_hits, bm.prefix_queries) == (8, 8 + 7 + 9)


def test_running_sequence_preempts_the_last_admitted_one():
    bm = BlockManager(6, 2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [make_seq(i, 4, first=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched)  # 2 blocks each: all 6 used
    out = run_step(sched)  # seq 0 needs a block: seq 2 goes; seq 1 then needs one too: and takes seq 2's
    assert [s.seq_id for s in out.preempted] == [2]
    assert plan(out) == [(0, 1), (1, 1)]
    assert [s.seq_id for s in sched.waiting] == [2] and [s.seq_id for s in sched.running] == [0, 1]


def test_prefix_hit_on_admission_skips_cached_blocks():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq(1, 10)
    sched.add(a)
    run_step(sched)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    b = Sequence(2, "r2", 0, list(range(8)) + [77, 78], SamplingParams.greedy())
    sched.add(b)
    out = run_step(sched)
    assert plan(out) == [(2, 2)] and b.num_cached_tokens == 8
    assert bm.block_table(2)[:2] == [0, 1]
    assert (bm.prefix_hits, bm.prefix_queries) == (8, 20)


def test_fork_shares_the_prompt_and_copies_on_write():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    parent = make_seq(1, 6)
    sched.add(parent)
    run_step(sched)
    child = Sequence(2, "r1", 1, parent.prompt_token_ids, parent.params, output_token_ids=[555])
    sched.fork(parent, child)
    assert bm.block_table(2) == [0, 1] and child.num_computed_tokens == 6
    out = run_step(sched)
    assert plan(out) == [(1, 1), (2, 1)]
    assert out.block_copies == [(1, 2)]  # the parent wrote first: it took the copy
    assert (bm.block_table(1), bm.block_table(2)) == ([0, 2], [0, 1])
    for s in (parent, child):
        sched.finish(s, SequenceStatus.FINISHED_STOPPED)
    assert bm.num_used_blocks == 0 and not sched.has_unfinished()


def test_finished_states_sort_after_live_ones():
    live = [SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.PREEMPTED]
    assert not any(s.is_finished for s in live)
    assert all(s.is_finished for s in SequenceStatus if s not in live)
    assert SequenceStatus.finished_by("length").finish_reason == "length"
