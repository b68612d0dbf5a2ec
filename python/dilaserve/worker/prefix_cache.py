"""Prefix sharing for block diffusion's exact KV cache: the K/V of a prompt's whole blocks
is final once computed (later positions never change it), so a request whose prompt starts
with blocks another request already computed reads their K/V instead of recomputing it.

Blocks are keyed by their content and everything before them (a chain: the previous
block's key and this block's tokens — content and position, as vLLM's prefix caching and
SGLang's block radix cache key them), compared exactly, never by a hash alone. Each stored
block is an evictable extent of the KV pool, placed only in free rows: the store never takes
room a request needs, since the pool evicts the stored blocks in a request's way (those of
the free run that evicts fewest) before it refuses or compacts; to store a block where no
run is free, the store evicts its own least recently used blocks.

A request that hits reads the stored blocks where they are (its attention takes their pool
rows, then its extent's) and pins them, so they are held once however many requests read
them and are not evicted until the last reader leaves (reference counts); its own extent
holds only the positions after them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from dilaserve.protocol import PrefixUse, block_key
from dilaserve.worker.kv_cache import CacheFullError, KVCachePool, Move

#: A stored block's key: the key id of the block before it (0 for the first) and its tokens.
BlockKey = tuple[int, tuple[int, ...]]


@dataclass
class _Entry:
    key_id: int  # names this block as the parent of the next one
    pool_id: int  # its extent's id in the pool
    reported: int  # its key in reports (`protocol.prompt_block_keys`)


class PrefixCache:
    """Computed prompt blocks of `block` tokens, kept in the free space of `pool`."""

    def __init__(self, pool: KVCachePool, block: int) -> None:
        self.pool = pool
        self.block = block
        self._entries: OrderedDict[BlockKey, _Entry] = OrderedDict()  # oldest use first
        self._keys: dict[int, BlockKey] = {}  # pool id -> key
        self._ids = itertools.count(1)
        self._readers: dict[int, list[_Entry]] = {}  # request id -> the blocks it reads
        self.stats = PrefixUse()
        pool.on_evict = self._forget

    def __len__(self) -> int:
        return len(self._entries)

    def _blocks(self, prompt: list[int]) -> range:
        return range(0, len(prompt) - len(prompt) % self.block, self.block)

    def acquire(self, request_id: int, prompt: list[int]) -> int:
        """Pins `prompt`'s longest stored run of leading blocks for `request_id`, which
        reads them until `release`; the positions they cover."""
        if request_id in self._readers:
            raise ValueError(f"request {request_id} already reads a stored prefix")
        self.stats.queried_tokens += len(self._blocks(prompt)) * self.block
        hits: list[BlockKey] = []
        read: list[_Entry] = []
        parent = 0
        for start in self._blocks(prompt):
            key = (parent, tuple(prompt[start : start + self.block]))
            entry = self._entries.get(key)
            if entry is None:
                break
            hits.append(key)
            read.append(entry)
            parent = entry.key_id
        for entry in read:
            self.pool.pin(entry.pool_id)
        self._readers[request_id] = read
        self._touch(hits)
        covered = len(hits) * self.block
        self.stats.hit_tokens += covered
        return covered

    def segments(self, request_id: int) -> tuple[tuple[int, int], ...]:
        """The pool rows of `request_id`'s shared blocks as (first row, length) runs, in
        position order (adjacent blocks joined)."""
        runs: list[tuple[int, int]] = []
        for entry in self._readers.get(request_id, ()):
            row = self.pool.base(entry.pool_id)
            if runs and runs[-1][0] + runs[-1][1] == row:
                runs[-1] = (runs[-1][0], runs[-1][1] + self.block)
            else:
                runs.append((row, self.block))
        return tuple(runs)

    def reads(self, request_id: int) -> list[int]:
        """The report keys of the stored blocks `request_id` reads, in prompt order."""
        return [entry.reported for entry in self._readers.get(request_id, ())]

    def release(self, request_id: int) -> None:
        """`request_id` no longer reads its shared blocks (a no-op if it read none)."""
        for entry in self._readers.pop(request_id, ()):
            self.pool.unpin(entry.pool_id)

    def store(self, request_id: int, prompt: list[int], base: int) -> None:
        """Keeps the K/V of `prompt`'s whole blocks, final in `request_id`'s extent (its
        position `p` at pool row `base + p`; the blocks it read shared are stored already),
        in room no request holds (evicting the least recently used unread blocks)."""
        chain: list[BlockKey] = []
        added: list[tuple[BlockKey, int]] = []  # new blocks and their prompt positions
        parent = reported = 0
        for start in self._blocks(prompt):
            tokens = tuple(prompt[start : start + self.block])
            key = (parent, tokens)
            entry = self._entries.get(key)
            if entry is None:
                key_id = next(self._ids)
                if not self._place(-key_id, set(chain)):
                    break
                entry = _Entry(key_id, pool_id=-key_id, reported=block_key(reported, tokens))
                self._entries[key] = entry
                self._keys[entry.pool_id] = key
                added.append((key, start))
            chain.append(key)
            parent, reported = entry.key_id, entry.reported
        self.pool.copy(
            [
                Move(base + start, self.pool.base(self._entries[key].pool_id), self.block)
                for key, start in added
            ]
        )
        self._touch(chain)

    def _touch(self, chain: list[BlockKey]) -> None:
        """Marks `chain` used, its root last, so the store's own evictions take a chain
        from its end."""
        for key in reversed(chain):
            self._entries.move_to_end(key)

    def _place(self, pool_id: int, keep: set[BlockKey]) -> bool:
        """Allocates a block's extent in free rows, evicting stored blocks no request reads
        outside `keep`, least recently used first, until a run is free; False if none can be."""
        while True:
            try:
                self.pool.allocate(pool_id, self.block, evictable=True)
                return True
            except CacheFullError:
                oldest = next(
                    (
                        k
                        for k, e in self._entries.items()
                        if k not in keep and not self.pool.pinned(e.pool_id)
                    ),
                    None,
                )
                if oldest is None:
                    return False
                self.pool.free(self._entries[oldest].pool_id)
                self._forget([self._entries[oldest].pool_id])

    def _forget(self, pool_ids: list[int]) -> None:
        """Drops the entries of evicted extents (the pool's `on_evict`). A block whose
        parent is gone is never found again and ages out."""
        for pool_id in pool_ids:
            del self._entries[self._keys.pop(pool_id)]
