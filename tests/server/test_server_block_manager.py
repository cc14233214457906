"""Block manager unit tests: exact block ids, refcounts, prefix hits, LRU eviction order, copy-on-write."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from native_server.engine.block_manager import BlockManager, FreeBlockQueue, KVBlock, extend_block_hashes, hash_block
from tests.paths import REPO


def hashes(tokens, block_size=4):
    return extend_block_hashes([], tokens, block_size)


def check_accounting(bm: BlockManager) -> None:
    """The O(1) counters agree with a brute-force count."""
    used = sum(b.ref_cnt > 0 for b in bm.blocks)
    cached_free = sum(b.ref_cnt == 0 and b.block_hash is not None for b in bm.blocks)
    assert bm.num_used_blocks == used
    assert bm.num_free_blocks == bm.num_blocks - used == len(bm.free_queue.block_ids())
    assert bm.num_cached_blocks == cached_free
    assert all(bm.cached[b.block_hash] is b for b in bm.blocks if b.block_hash is not None)


def test_allocation_hands_out_blocks_in_order_and_counts_slots():
    bm = BlockManager(8, block_size=4)
    assert bm.allocate("a", 0, 10) == []
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.allocate("b", 0, 4) == []
    assert bm.block_table("b") == [3]
    assert bm.allocate("a", 10, 2) == []  # 12 slots still fit in 3 blocks
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.allocate("a", 12, 1) == []
    assert bm.block_table("a") == [0, 1, 2, 4]
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (5, 3, 0)
    check_accounting(bm)


def test_allocation_fails_without_side_effects():
    bm = BlockManager(4, block_size=4)
    bm.allocate("a", 0, 12)
    assert bm.allocate("b", 0, 8) is None
    assert bm.block_table("b") == []
    assert bm.free_queue.block_ids() == [3]
    assert bm.allocate("b", 0, 4) == []
    assert bm.block_table("b") == [3]
    check_accounting(bm)


def test_free_queue_unlinks_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    queue.remove(blocks[4])
    assert queue.block_ids() == [2, 0, 1, 3]
    assert [queue.popleft().block_id for _ in range(4)] == [2, 0, 1, 3]
    with pytest.raises(IndexError):
        queue.popleft()


def test_unhashed_blocks_return_to_the_front_in_table_order():
    bm = BlockManager(6, block_size=4)
    bm.allocate("a", 0, 12)
    bm.free("a")
    assert bm.free_queue.block_ids() == [0, 1, 2, 3, 4, 5]
    check_accounting(bm)


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    bm = BlockManager(8, block_size=4)
    prompt = list(range(10))
    bm.allocate("a", 0, 10)
    bm.cache_blocks("a", hashes(prompt), 10)
    assert [b.block_id for b in bm.cached.values()] == [0, 1]  # the two full blocks; 2 is partial
    bm.free("a")
    # Block 2 (no hash) goes to the front; the cached ones to the back, tail block first.
    assert bm.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.num_cached_blocks == 2
    other = prompt[:8] + [99, 98, 97]
    hit = bm.cached_prefix(hashes(other), len(other))
    assert [b.block_id for b in hit] == [0, 1]
    assert bm.allocate("b", 8, 3, hit) == []
    bm.record_prefix_lookup(len(other), 8)
    assert bm.block_table("b") == [0, 1, 2]
    assert bm.free_queue.block_ids() == [3, 4, 5, 6, 7]
    assert (bm.prefix_queries, bm.prefix_hits, bm.num_cached_blocks) == (11, 8, 0)
    check_accounting(bm)


def test_shared_prefix_between_live_sequences_is_counted_twice():
    bm = BlockManager(8, block_size=4)
    prompt = list(range(9))
    bm.allocate("a", 0, 9)
    bm.cache_blocks("a", hashes(prompt), 9)
    hit = bm.cached_prefix(hashes(prompt), 9)
    assert bm.allocate("b", 8, 1, hit) == []
    assert bm.block_table("b") == [0, 1, 3]
    assert [bm.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    bm.free("a")
    assert [bm.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    bm.free("b")
    assert bm.free_queue.block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]
    check_accounting(bm)


def test_whole_prompt_in_cache_still_recomputes_its_last_block():
    bm = BlockManager(8, block_size=4)
    prompt = list(range(8))
    bm.allocate("a", 0, 8)
    bm.cache_blocks("a", hashes(prompt), 8)
    # The last token must run to produce logits, so only the first block is taken.
    assert [b.block_id for b in bm.cached_prefix(hashes(prompt), 8)] == [0]
    assert [b.block_id for b in bm.cached_prefix(hashes(prompt), 9)] == [0, 1]


def test_lru_eviction_order():
    bm = BlockManager(6, block_size=2)
    for name, first in (("a", 0), ("b", 10), ("c", 20)):
        tokens = list(range(first, first + 4))
        bm.allocate(name, 0, 4)
        bm.cache_blocks(name, hashes(tokens, 2), 4)
    assert [bm.block_table(n) for n in "abc"] == [[0, 1], [2, 3], [4, 5]]
    bm.free("b")
    bm.free("a")
    bm.free("c")
    # Least recently freed first; within a sequence, its tail before its head.
    assert bm.free_queue.block_ids() == [3, 2, 1, 0, 5, 4]
    assert bm.num_cached_blocks == 6
    evicted = []
    for i in range(4):
        before = set(b.block_id for b in bm.cached.values())
        bm.allocate(f"new{i}", 0, 2)
        evicted += sorted(before - set(b.block_id for b in bm.cached.values()))
    assert evicted == [3, 2, 1, 0]
    assert [b.block_id for b in bm.cached_prefix(hashes(list(range(20, 25)), 2), 5)] == [4, 5]
    assert bm.cached_prefix(hashes(list(range(10, 15)), 2), 5) == []  # b's head went with its tail
    check_accounting(bm)


def test_a_block_computed_twice_is_cached_once():
    bm = BlockManager(4, block_size=4)
    prompt = [5, 6, 7, 8, 9]
    bm.allocate("a", 0, 5)
    bm.allocate("b", 0, 5)
    bm.cache_blocks("a", hashes(prompt), 5)
    bm.cache_blocks("b", hashes(prompt), 5)
    assert bm.cached[hash_block(None, prompt[:4])].block_id == 0
    bm.free("b")
    assert bm.free_queue.block_ids() == [2, 3]  # b's first block held nothing reusable
    check_accounting(bm)


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(8, block_size=4)
    bm.allocate("p", 0, 6)  # a 6-token prompt: block 1 is half full
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    assert bm.block_table("c1") == bm.block_table("c2") == [0, 1]
    assert [bm.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    assert bm.num_used_blocks == 2
    # Each writer of the shared half-full block gets its own copy; the last one keeps the original.
    assert bm.allocate("c1", 6, 1) == [(1, 2)]
    assert bm.allocate("c2", 6, 1) == [(1, 3)]
    assert bm.allocate("p", 6, 1) == []
    assert [bm.block_table(s) for s in ("p", "c1", "c2")] == [[0, 1], [0, 2], [0, 3]]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [3, 1, 1, 1]
    for seq in ("c2", "p", "c1"):
        bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    check_accounting(bm)


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(8, block_size=4)
    bm.allocate("p", 0, 8)
    bm.fork("p", "c")
    assert bm.allocate("c", 8, 1) == []
    assert bm.block_table("c") == [0, 1, 2]
    assert bm.allocate("p", 8, 1) == []
    assert bm.block_table("p") == [0, 1, 3]


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(2, block_size=4)
    bm.allocate("p", 0, 6)
    bm.fork("p", "c")
    assert bm.allocate("c", 6, 1) is None
    assert bm.block_table("c") == [0, 1] and bm.blocks[1].ref_cnt == 2


def test_prefix_caching_off():
    bm = BlockManager(4, block_size=4, enable_prefix_caching=False)
    bm.allocate("a", 0, 8)
    bm.cache_blocks("a", hashes(list(range(8))), 8)
    assert not bm.cached and bm.cached_prefix(hashes(list(range(8))), 9) == []


def test_chained_hash_depends_on_the_whole_prefix():
    a, b = hashes([1, 2, 3, 4, 5, 6, 7, 8]), hashes([0, 2, 3, 4, 5, 6, 7, 8])
    assert a[1].token_ids == b[1].token_ids and a[1] != b[1]
    assert hashes([1, 2, 3, 4, 5, 6, 7]) == a[:1]


def test_scheduler_block_manager_and_outputs_import_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules['torch'] = None
        sys.modules['numpy'] = None
        import native_server.engine.block_manager, native_server.engine.scheduler, native_server.engine.sequence, native_server.engine.outputs
        assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') and sys.modules[m]]
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
