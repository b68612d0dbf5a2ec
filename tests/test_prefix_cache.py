"""The prefix store of the exact block cache: hits copy exactly the K/V a prompt's shared
leading blocks were computed with, and stored blocks live only in room no request holds."""

from __future__ import annotations

import torch

from dilaserve.worker.kv_cache import KVCachePool
from dilaserve.worker.prefix_cache import PrefixCache

BLOCK = 2


def _pool(capacity: int) -> KVCachePool:
    return KVCachePool(1, capacity, 1, 1, torch.float32, "cpu")


def _write_positions(pool: KVCachePool, rid: int, values: list[float]) -> None:
    base, _ = pool.extent(rid)
    slots = torch.arange(base, base + len(values))
    v = torch.tensor(values).view(-1, 1, 1)
    pool.write(0, slots, v, -v)


def _read(pool: KVCachePool, rid: int, n: int) -> list[float]:
    base, _ = pool.extent(rid)
    keys, values = pool.layer(0)
    assert torch.equal(values[base : base + n], -keys[base : base + n])
    return keys[base : base + n].flatten().tolist()


def test_a_hit_copies_the_longest_run_of_stored_leading_blocks():
    pool = _pool(32)
    store = PrefixCache(pool, BLOCK)
    pool.allocate(1, 6)
    _write_positions(pool, 1, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    store.store(1, [7, 7, 8, 8, 9])  # two whole blocks; the fifth token is not one
    assert len(store) == 2
    pool.allocate(2, 6)
    # Same first block, different second: only the first is shared.
    assert store.load(2, [7, 7, 8, 0, 9, 9]) == 2
    assert _read(pool, 2, 2) == [1.0, 2.0]
    pool.allocate(3, 6)
    # The second block alone is no hit: a block's key is its content and all before it.
    assert store.load(3, [0, 0, 8, 8]) == 0
    pool.allocate(4, 6)
    assert store.load(4, [7, 7, 8, 8, 1, 1]) == 4
    assert _read(pool, 4, 4) == [1.0, 2.0, 3.0, 4.0]
    assert store.stats.hit_tokens == 6 and store.stats.looked_up_tokens == 6 + 4 + 6


def test_stored_blocks_give_way_to_a_request_without_compacting_the_pool():
    pool = _pool(12)
    store = PrefixCache(pool, BLOCK)
    pool.allocate(1, 4)
    _write_positions(pool, 1, [1.0, 2.0, 3.0, 4.0])
    store.store(1, [1, 1, 2, 2])  # rows 4-7
    pool.free(1)
    pool.allocate(2, 4)
    _write_positions(pool, 2, [5.0, 6.0, 7.0, 8.0])
    store.store(2, [3, 3, 4, 4])  # rows 8-11
    assert len(store) == 4 and pool.free_tokens == 0 and pool.evictable_tokens == 8
    pool.free(2)
    pool.allocate(3, 4)
    assert store.load(3, [1, 1, 2, 2]) == 4 and _read(pool, 3, 4) == [1.0, 2.0, 3.0, 4.0]
    # No row is free: the request takes the first run of stored blocks long enough, in
    # place; the blocks it evicts are forgotten, the one left is no hit without its parent.
    assert pool.allocate(4, 6) == 4 and pool.compactions == 0
    assert len(store) == 1
    assert store.load(4, [3, 3, 4, 4]) == 0 and store.load(4, [1, 1, 2, 2]) == 0
    # Free rows and a stored block that a held extent separates: only compaction fits 6.
    pool.free(3)
    pool.allocate(5, 6)
    assert pool.compactions == 1 and len(store) == 0 and pool.free_tokens == 0


def test_storing_never_evicts_the_prompt_being_stored_nor_takes_a_requests_room():
    pool = _pool(8)
    store = PrefixCache(pool, BLOCK)
    pool.allocate(1, 6)
    _write_positions(pool, 1, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    store.store(1, [1, 1, 2, 2, 3, 3])  # room for one block
    assert len(store) == 1 and pool.free_tokens == 0
    pool.allocate(2, 2)
    assert len(store) == 0
