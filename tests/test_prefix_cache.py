"""The prefix store of the exact block cache: a hit reads in place exactly the K/V a
prompt's shared leading blocks were computed with, pinned while read (held once, however
many requests read it), and stored blocks live only in room no request holds."""

from __future__ import annotations

import torch

from dilaserve.protocol import prompt_block_keys
from dilaserve.worker.kv_cache import CacheFullError, CacheSlotError, KVCachePool
from dilaserve.worker.prefix_cache import PrefixCache

BLOCK = 2


def _pool(capacity: int) -> KVCachePool:
    return KVCachePool(1, capacity, 1, 1, torch.float32, "cpu")


def _write_positions(pool: KVCachePool, rid: int, values: list[float]) -> None:
    base, _ = pool.extent(rid)
    slots = torch.arange(base, base + len(values))
    v = torch.tensor(values).view(-1, 1, 1)
    pool.write(0, slots, v, -v)


def _read_shared(store: PrefixCache, rid: int) -> list[float]:
    """The keys of the positions `rid` reads shared, in position order."""
    keys, values = store.pool.layer(0)
    rows = [r for start, n in store.segments(rid) for r in range(start, start + n)]
    assert torch.equal(values[rows], -keys[rows])
    return keys[rows].flatten().tolist()


def _one_prompt_stored() -> tuple[KVCachePool, PrefixCache]:
    """A pool of 12 rows whose store holds the blocks [1, 1] and [2, 2] (keys 1.0-4.0) at
    rows 4-7, the request that computed them gone."""
    pool = _pool(12)
    store = PrefixCache(pool, BLOCK)
    pool.allocate(1, 4)
    _write_positions(pool, 1, [1.0, 2.0, 3.0, 4.0])
    store.store(1, [1, 1, 2, 2], pool.base(1))
    pool.free(1)
    return pool, store


def test_a_hit_reads_the_longest_run_of_stored_leading_blocks_in_place():
    pool = _pool(32)
    store = PrefixCache(pool, BLOCK)
    pool.allocate(1, 6)
    _write_positions(pool, 1, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    store.store(1, [7, 7, 8, 8, 9], pool.base(1))  # two whole blocks; the fifth is not one
    assert len(store) == 2
    # Same first block, different second: only the first is shared.
    assert store.acquire(2, [7, 7, 8, 0, 9, 9]) == 2
    assert _read_shared(store, 2) == [1.0, 2.0]
    # The second block alone is no hit: a block's key is its content and all before it.
    assert store.acquire(3, [0, 0, 8, 8]) == 0 and store.segments(3) == ()
    assert store.acquire(4, [7, 7, 8, 8, 1, 1]) == 4
    assert _read_shared(store, 4) == [1.0, 2.0, 3.0, 4.0]
    assert len(store.segments(4)) == 1  # stored side by side: one run
    assert store.stats.hit_tokens == 6 and store.stats.queried_tokens == 6 + 4 + 6


def test_shared_blocks_are_held_once_and_evicted_only_after_their_last_reader():
    pool, store = _one_prompt_stored()
    # Three readers of the same two blocks: four rows held in all, not twelve.
    for rid in (2, 3, 4):
        assert store.acquire(rid, [1, 1, 2, 2, 5, 5]) == 4
        pool.allocate(rid, 2)  # its own extent: the positions after the shared blocks
    assert pool.free_tokens == 12 - 4 - 3 * 2 and pool.evictable_tokens == 0
    # A request that needs the rows finds none it may evict while the blocks are read.
    for rid in (2, 3):
        pool.free(rid)
        store.release(rid)
    try:
        pool.allocate(5, 8)
        raise AssertionError("evicted a block that a request still reads")
    except CacheFullError:
        pass
    assert _read_shared(store, 4) == [1.0, 2.0, 3.0, 4.0]
    pool.free(4)
    store.release(4)
    assert pool.evictable_tokens == 4
    pool.allocate(5, 8)  # the last reader gone, the blocks give way
    assert len(store) == 0


def test_stored_blocks_give_way_to_a_request_without_compacting_the_pool():
    pool, store = _one_prompt_stored()
    pool.allocate(2, 4)
    _write_positions(pool, 2, [5.0, 6.0, 7.0, 8.0])
    store.store(2, [3, 3, 4, 4], pool.base(2))  # rows 8-11
    assert len(store) == 4 and pool.free_tokens == 0 and pool.evictable_tokens == 8
    pool.free(2)
    pool.allocate(3, 4)
    # No row is free: the request takes the first run of stored blocks long enough, in
    # place; the blocks it evicts are forgotten, the one left is no hit without its parent.
    assert pool.allocate(4, 6) == 4 and pool.compactions == 0
    assert len(store) == 1
    assert store.acquire(5, [3, 3, 4, 4]) == 0 and store.acquire(6, [1, 1, 2, 2]) == 0
    # Free rows and a stored block that a held extent separates: only compaction fits 6.
    pool.free(3)
    pool.allocate(7, 6)
    assert pool.compactions == 1 and len(store) == 0 and pool.free_tokens == 0


def test_storing_never_evicts_the_prompt_being_stored_nor_takes_a_requests_room():
    pool = _pool(8)
    store = PrefixCache(pool, BLOCK)
    pool.allocate(1, 6)
    _write_positions(pool, 1, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    store.store(1, [1, 1, 2, 2, 3, 3], pool.base(1))  # room for one block
    assert len(store) == 1 and pool.free_tokens == 0
    pool.allocate(2, 2)
    assert len(store) == 0


def test_a_stored_extent_that_is_read_cannot_be_freed():
    pool = _pool(8)
    pool.allocate(-1, 2, evictable=True)
    pool.pin(-1)
    try:
        pool.free(-1)
        raise AssertionError("freed a pinned extent")
    except CacheSlotError:
        pass
    pool.unpin(-1)
    pool.free(-1)


def test_a_reader_names_the_blocks_it_reads_by_the_keys_the_engine_computes():
    _, store = _one_prompt_stored()
    prompt = [1, 1, 2, 2, 5, 5]
    store.acquire(2, prompt)
    assert store.reads(2) == prompt_block_keys(prompt, BLOCK)[:2]
    store.acquire(3, [9, 9, 1, 1])
    assert store.reads(3) == []
    store.release(2)
    assert store.reads(2) == []
