"""The KV pool: budget sizing, token-granular extents, errors, compaction."""

from __future__ import annotations

import pytest
import torch

from dilaserve.worker.errors import CacheFullError, CacheSlotError
from dilaserve.worker.kv_cache import (
    KVCachePool,
    Move,
    budget_tokens,
    bytes_per_token,
    parse_kv_memory,
)


def _pool(capacity: int = 40, **kw) -> KVCachePool:
    return KVCachePool(2, capacity, 2, 4, torch.float32, "cpu", **kw)


def _fill(pool: KVCachePool, rid: int) -> None:
    """Writes `rid` into every row of its extent, in every layer."""
    base, length = pool.extent(rid)
    slots = torch.arange(base, base + length)
    value = torch.full((length, 2, 4), float(rid))
    for layer in range(2):
        pool.write(layer, slots, value, -value)


def _content(pool: KVCachePool, rid: int) -> set[float]:
    base, length = pool.extent(rid)
    keys, values = pool.layer(1)
    assert torch.equal(values[base : base + length], -keys[base : base + length])
    return set(keys[base : base + length].unique().tolist())


def test_bytes_per_token_is_k_and_v_of_every_layer():
    # LLaDA-8B: 32 layers, 32 KV heads of 128, bfloat16 -> 512 KiB per token.
    assert bytes_per_token(32, 32, 128, torch.bfloat16) == 512 * 1024
    assert _pool().bytes_per_token == 2 * 2 * 2 * 4 * 4


def test_budget_in_bytes_or_fraction_capped_by_what_requests_can_use():
    cpu = torch.device("cpu")
    assert budget_tokens(1000, 10, cpu, most=10**9) == 100
    assert budget_tokens(1000, 10, cpu, most=64) == 64
    # A LLaDA-8B pool of 8 GiB holds 16384 tokens, not 64 x 4096.
    assert budget_tokens(8 * 2**30, 512 * 1024, cpu, most=64 * 4096) == 16384
    half = budget_tokens(0.5, 1, cpu, most=10**18)
    assert 0 < half <= budget_tokens(1.0, 1, cpu, most=10**18)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="KV-cache memory"):
            budget_tokens(bad, 10, cpu, most=10)


def test_parse_kv_memory_reads_fractions_and_sizes():
    assert parse_kv_memory("0.5") == 0.5
    assert parse_kv_memory("8GiB") == 8 * 2**30
    assert parse_kv_memory("512MiB") == 512 * 2**20
    assert parse_kv_memory("4G") == 4 * 10**9
    assert parse_kv_memory("2000000") == 2_000_000
    for bad in ("1.5", "0", "-3", "lots", "8XB"):
        with pytest.raises(ValueError, match="neither a fraction"):
            parse_kv_memory(bad)


def test_extents_are_token_granular_and_reused():
    pool = _pool(40)
    assert pool.allocate(1, 13) == 0
    assert pool.allocate(2, 27) == 13
    assert pool.free_tokens == 0
    with pytest.raises(CacheFullError, match="needs 1 KV tokens, 0 of 40"):
        pool.allocate(3, 1)
    pool.free(1)
    assert pool.allocate(3, 13) == 0  # the freed extent, exactly
    pool.free(2)
    pool.free(3)
    assert pool.free_tokens == 40
    assert pool.allocate(4, 40) == 0  # holes merged back into one


def test_double_free_and_unknown_requests_are_errors():
    pool = _pool()
    pool.allocate(1, 5)
    with pytest.raises(CacheSlotError, match="already holds"):
        pool.allocate(1, 5)
    pool.free(1)
    with pytest.raises(CacheSlotError, match="holds no KV extent"):
        pool.free(1)
    with pytest.raises(CacheSlotError, match="holds no KV extent"):
        pool.base(7)
    with pytest.raises(ValueError, match="positive length"):
        pool.allocate(2, 0)


def test_compaction_moves_extents_with_their_contents():
    """Holes that are together big enough but apart too small are closed by moving the
    live extents down; their K/V move with them, and `on_move` hears of every move."""
    heard: list[list[Move]] = []
    pool = _pool(40, on_move=heard.append)
    for rid, length in ((1, 10), (2, 10), (3, 10), (4, 10)):
        pool.allocate(rid, length)
        _fill(pool, rid)
    pool.free(1)
    pool.free(3)
    assert pool.free_tokens == 20
    assert pool.allocate(5, 15) == 20  # no hole of 15: 2 and 4 slide down first
    assert pool.compactions == 1
    assert heard == [[Move(10, 0, 10), Move(30, 10, 10)]]
    assert pool.base(2) == 0 and pool.base(4) == 10
    assert _content(pool, 2) == {2.0} and _content(pool, 4) == {4.0}
    assert pool.free_tokens == 5


def test_moves_replayed_on_a_mirror_pool_give_the_same_rows():
    """What a tensor-parallel follower does with rank 0's moves."""
    heard: list[list[Move]] = []
    main, mirror = _pool(30, on_move=heard.append), _pool(30)
    for rid, length in ((1, 8), (2, 12), (3, 10)):
        for pool in (main, mirror):
            pool.allocate(rid, length)
            _fill(pool, rid)
    main.free(1)
    main.free(3)
    main.allocate(4, 18)
    mirror.apply_moves(heard[0])
    assert torch.equal(main.keys[0][:12], mirror.keys[0][:12])
    assert _content(main, 2) == {2.0}
