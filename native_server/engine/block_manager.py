"""KV-cache block allocation: fixed-size blocks, reference counts, prefix caching.

The paged KV cache is cut into blocks of `block_size` token slots. A sequence
owns a block table (block ids in position order); several sequences may hold
the same block, counted by its `ref_cnt`:
  * prefix caching: every *full* block whose KV has been computed is entered in
    a table under a hash chained over all the tokens up to and including it,
    so a later sequence with the same prefix reuses the block instead of
    recomputing it. A cached block whose last holder lets go stays in the
    table, reusable, until the free queue hands it out again (LRU eviction);
  * forking (n > 1 samples): the children share the parent's table; a child
    about to write into a shared, partly filled block gets a private copy
    first (copy-on-write: the caller copies the device memory).

Two tiers (the int8/int4 KV cache, py_engine/models/kv_quant.py): with
`num_cold_blocks` and `hot_tokens`, a second pool holds quantized blocks
with ids of their own. New tokens always go to hot blocks; when a sequence
is scheduled from position p, every leading block that a query at p reads
cold is demoted: it gets a cold block (the caller quantizes the hot one into
it before the step, `take_demotions`), its hot block is let go, and its
prefix-cache entry moves with it, so a cached block is hot or cold, never
both. A table is thus cold blocks, then hot ones.

Pure Python (no torch): the scheduler and these tests run anywhere.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple, Sequence

SeqId = Hashable


class BlockHash(NamedTuple):
    """Identity of one full block: a hash chained over the whole prefix, and the block's own tokens.

    Keeping token_ids in the key means two blocks collide only if both their
    tokens and their parents' 64-bit values are equal, never on tokens alone.
    """

    value: int
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], root: int = 0) -> BlockHash:
    """hash(parent's value, tuple(ids)); Python hashes ints and tuples the same in every process.

    root stands in for the first block's parent: the same tokens under another LoRA adapter (whose KV
    differs) start another chain, so no block is ever shared across adapters (root 0: the base model)."""
    ids = tuple(token_ids)
    return BlockHash(hash((root if parent is None else parent.value, ids)), ids)


def extend_block_hashes(hashes: list[BlockHash], new_token_ids: Sequence[int], block_size: int,
                        root: int = 0) -> list[BlockHash]:
    """Append the hashes of the full blocks of new_token_ids, the tokens that follow the hashed blocks."""
    for start in range(0, len(new_token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, new_token_ids[start:start + block_size], root))
    return hashes


def adapter_root(load_id: int | None) -> int:
    """The hash chain's root for sequences of one loaded adapter (load_id: unique per load; None: the base)."""
    return 0 if load_id is None else hash(("lora", load_id)) or 1


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full, computed and cached
    cold: bool = False  # a block of the quantized pool
    demoted_to: KVBlock | None = None  # hot: its cold copy, while others still hold it hot
    source: KVBlock | None = None  # cold: the hot block it was made from (demoted_to's back link)
    prev: KVBlock | None = None  # links of the free queue; None while the block is in use
    next: KVBlock | None = None


class FreeBlockQueue:
    """The blocks nobody holds, in the order they will be handed out (head first).

    A doubly linked list threaded through the blocks themselves, not a deque:
    a prefix-cache hit revives a free block from anywhere in the queue, and
    removing from the middle of a deque costs O(n); unlinking here is O(1).
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head, self._tail = KVBlock(-1), KVBlock(-1)  # sentinels: no edge cases at the ends
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVBlock:
        if self.num_free == 0:
            raise IndexError("no free KV blocks")
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, f"block {block.block_id} is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        self._insert(block, self._tail.prev)

    def appendleft(self, block: KVBlock) -> None:
        self._insert(block, self._head)

    def _insert(self, block: KVBlock, after: KVBlock | None) -> None:
        assert after is not None and after.next is not None
        block.prev, block.next = after, after.next
        after.next.prev = block
        after.next = block
        self.num_free += 1

    def block_ids(self) -> list[int]:
        """Head to tail; for tests and debugging."""
        out, block = [], self._head.next
        while block is not self._tail and block is not None:
            out.append(block.block_id)
            block = block.next
        return out


class BlockManager:
    """Owns every KV block: block tables per sequence, refcounts, the prefix cache and the free queue."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 num_cold_blocks: int = 0, hot_tokens: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        if num_cold_blocks and (hot_tokens is None or hot_tokens < 0):
            raise ValueError("a cold pool needs hot_tokens >= 0")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.num_cold_blocks, self.hot_tokens = num_cold_blocks, hot_tokens
        self.cold_blocks = [KVBlock(i, cold=True) for i in range(num_cold_blocks)]
        self.cold_free_queue = FreeBlockQueue(self.cold_blocks)
        self._demotions: list[tuple[int, int]] = []  # (hot id, cold id) to quantize before the next step
        self.num_demoted = 0  # blocks quantized into the cold pool, since start
        self.cached: dict[BlockHash, KVBlock] = {}
        self._tables: dict[SeqId, list[KVBlock]] = {}
        self._num_hashed: dict[SeqId, int] = {}  # leading blocks of a table already in the cache
        self._num_cached_free = 0  # free blocks still holding a reusable prefix
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    # --- accounting -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached ones included (they are evicted on demand)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free_queue)

    @property
    def num_used_cold_blocks(self) -> int:
        return self.num_cold_blocks - len(self.cold_free_queue)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """Block ids in position order: the leading num_cold(seq_id) are ids of the cold pool."""
        return [b.block_id for b in self._tables.get(seq_id, ())]

    def num_cold(self, seq_id: SeqId) -> int:
        return sum(1 for b in self._tables.get(seq_id, ()) if b.cold)

    def cold_prefix(self, position: int) -> int:
        """Leading blocks a query at `position` reads cold (kv_quant.KVQuantConfig.cold_edge, in blocks)."""
        if not self.num_cold_blocks:
            return 0
        return max(0, position + 1 - self.hot_tokens) // self.block_size

    def take_demotions(self) -> list[tuple[int, int]]:
        """The (hot id, cold id) pairs to quantize, in order, before the step's copies and writes."""
        moves, self._demotions = self._demotions, []
        self.num_demoted += len(moves)
        return moves

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    # --- prefix cache -----------------------------------------------------------------------------
    def cached_prefix(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[KVBlock]:
        """The longest run of leading blocks already cached; no side effects.

        At most (num_tokens - 1) tokens are taken from the cache: the last token
        must run through the model to give the logits of the next one.
        """
        if not self.enable_prefix_caching:
            return []
        hit: list[KVBlock] = []
        for h in block_hashes[:(num_tokens - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        # A cold block is only of use where the sequence's first query reads it cold: its hot form is
        # gone. Cut the hit to the longest run whose cold blocks all lie before that query's cold edge.
        while hit and any(b.cold for b in hit[self.cold_prefix(len(hit) * self.block_size):]):
            hit.pop()
        return hit

    def cache_blocks(self, seq_id: SeqId, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Enter the sequence's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        end = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        for i in range(self._num_hashed[seq_id], end):
            block, h = table[i], block_hashes[i]
            # Another sequence may have computed the same block at the same time: keep the first.
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block
        self._num_hashed[seq_id] = max(self._num_hashed[seq_id], end)

    # --- allocation -------------------------------------------------------------------------------
    def allocate(self, seq_id: SeqId, num_computed_tokens: int, num_new_tokens: int,
                 cached: Sequence[KVBlock] = ()) -> list[tuple[int, int]] | None:
        """Grow seq_id's table to hold num_computed_tokens + num_new_tokens slots.

        `cached` (from cached_prefix, for a sequence with no table yet) becomes
        the head of the table. Returns the (src, dst) block copies to make before
        the new tokens are written (copy-on-write), or None, changing nothing,
        when there are not enough free blocks.
        """
        table = self._tables.get(seq_id, [])
        if cached:
            assert not table and num_computed_tokens == len(cached) * self.block_size
        num_needed = -(-(num_computed_tokens + num_new_tokens) // self.block_size) - len(table) - len(cached)
        first_write = num_computed_tokens // self.block_size
        shared = [i for i in range(first_write, len(table)) if table[i].ref_cnt > 1]
        revived = sum(1 for b in cached if b.ref_cnt == 0 and not b.cold)  # they leave the free queue
        demote = [b for b in [*table, *cached][:self.cold_prefix(num_computed_tokens)] if not b.cold]
        cold_needed = sum(1 for b in cached if b.ref_cnt == 0 and b.cold) + sum(
            1 for b in demote if b.demoted_to is None or b.demoted_to.ref_cnt == 0)
        freed = sum(1 for b in demote if b.ref_cnt <= 1)  # demoted before the new blocks are taken
        if (max(num_needed, 0) + len(shared) > len(self.free_queue) - revived + freed
                or cold_needed > len(self.cold_free_queue)):
            return None
        for block in cached:
            self._hold(block)
        table = self._tables.setdefault(seq_id, table)
        table.extend(cached)
        self._num_hashed.setdefault(seq_id, len(cached))
        for i in range(min(self.cold_prefix(num_computed_tokens), len(table))):
            if not table[i].cold:
                table[i] = self._demote(table[i])
        copies = []
        for i in shared:  # the other holders keep the original
            table[i].ref_cnt -= 1
            fresh = self._take_free()
            copies.append((table[i].block_id, fresh.block_id))
            table[i] = fresh
        table.extend(self._take_free() for _ in range(num_needed))
        return copies

    def trim(self, seq_id: SeqId, num_tokens: int) -> None:
        """Release the blocks past the first num_tokens slots of a table: rejected speculative drafts' blocks.
        Those were taken fresh for this sequence and never hashed (only computed tokens' full blocks are), so
        they go to the front of the free queue."""
        table = self._tables.get(seq_id)
        keep = -(-num_tokens // self.block_size)
        while table is not None and len(table) > keep:
            block = table.pop()
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                assert block.block_hash is None, "a trimmed block held a cached prefix"
                self._queue(block).appendleft(block)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares every block of the parent (copy-on-write at its first write)."""
        table = self._tables[parent_id]
        for block in table:
            block.ref_cnt += 1
        self._tables[child_id] = list(table)
        self._num_hashed[child_id] = self._num_hashed[parent_id]

    def free(self, seq_id: SeqId) -> None:
        """Release the sequence's blocks.

        In reverse order, so a sequence's tail blocks are evicted before its
        head, which is the part other prompts are likeliest to share. Blocks
        with no hash hold nothing reusable and go to the front: they are handed
        out before any cached block is evicted.
        """
        table = self._tables.pop(seq_id, [])
        self._num_hashed.pop(seq_id, None)
        for block in reversed(table):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._queue(block).appendleft(block)
                else:
                    self._queue(block).append(block)
                    self._num_cached_free += 1
                if block.demoted_to is not None:  # nobody reads it hot any more
                    block.demoted_to = None

    def _demote(self, hot: KVBlock) -> KVBlock:
        """The cold block that replaces `hot` in one table (allocate checked there is one to take)."""
        cold = hot.demoted_to
        if cold is not None:  # another holder demoted it already: share that copy
            self._hold(cold)
        else:
            cold = self._take_free(cold=True)
            self._demotions.append((hot.block_id, cold.block_id))
            cold.source = hot
        if hot.block_hash is not None:  # the prefix cache entry moves: hot or cold, never both
            cold.block_hash, hot.block_hash = hot.block_hash, None
            self.cached[cold.block_hash] = cold
        hot.ref_cnt -= 1
        if hot.ref_cnt == 0:
            hot.demoted_to = None
            self.free_queue.appendleft(hot)
        else:
            hot.demoted_to = cold
        return cold

    def _queue(self, block: KVBlock) -> FreeBlockQueue:
        return self.cold_free_queue if block.cold else self.free_queue

    def _hold(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:  # a block coming back from the free queue (a cached one, or a demoted copy)
            self._queue(block).remove(block)
            if block.block_hash is not None:
                self._num_cached_free -= 1
        block.ref_cnt += 1

    def _take_free(self, cold: bool = False) -> KVBlock:
        block = (self.cold_free_queue if cold else self.free_queue).popleft()
        if block.block_hash is not None:  # evict: its prefix is no longer reusable
            del self.cached[block.block_hash]
            block.block_hash = None
            self._num_cached_free -= 1
        if block.source is not None:  # its contents change: the hot block it was made from forgets it
            if block.source.demoted_to is block:
                block.source.demoted_to = None
            block.source = None
        block.demoted_to = None
        block.ref_cnt = 1
        return block
