"""The KV pool for approximate KV caching (Fast-dLLM prefix / dual cache), sized by a
memory budget and allocated by tokens.

Storage is token-major: per layer, K and V are `[capacity, kv_heads, head_dim]`, and a
request owns one contiguous extent of exactly its sequence length (prompt + padded
output, fixed at admission). Contiguity is what lets attention read a request's cache as a
view of the pool with no gather; fragmentation is undone by compaction (moving extents
down, rarely and only when a request would not otherwise fit), so the pool holds any set of
requests whose tokens add up to its capacity — the number the scheduler admits against.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dilaserve.kernels import scatter_kv
from dilaserve.worker.errors import CacheFullError, CacheSlotError

#: Share of the free device memory the pool takes when no budget is given: most of a GPU
#: (the weights are already loaded), a modest part of a host's RAM.
DEFAULT_FRACTION = {"cuda": 0.9, "cpu": 0.25}


@dataclass(frozen=True)
class Move:
    """An extent moved by compaction: `length` rows from `src` to `dst` (`dst < src`)."""

    src: int
    dst: int
    length: int


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token across every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_kv_memory(text: str) -> int | float:
    """A `--kv-cache-memory` value: a fraction of free device memory (`0.5`), or bytes
    (`2000000000`, `512MiB`, `8GiB`, `4G`)."""
    spec = text.strip().lower().removesuffix("b")
    number = spec.rstrip("kmgi")
    unit = spec[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0 or ("." in number and not unit and value > 1):
        raise ValueError(
            f"KV-cache memory {text!r} is neither a fraction in (0, 1] nor a byte count "
            "such as 8GiB"
        )
    if not unit and "." in number:
        return value
    return int(value * _UNITS[unit])


def free_memory(device: torch.device) -> int:
    """Bytes free on `device`: the CUDA allocator's view, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def budget_tokens(
    budget: int | float | None, per_token: int, device: torch.device, *, most: int
) -> int:
    """Tokens the pool holds: `budget` bytes (an int), a fraction of free device memory (a
    float in (0, 1]), or by default `DEFAULT_FRACTION` of it — never more than `most`, the
    tokens the instance's request limit can ever use."""
    if isinstance(budget, bool) or (budget is not None and budget <= 0):
        raise ValueError(f"KV-cache memory must be positive bytes or a fraction, got {budget!r}")
    if isinstance(budget, float):
        if budget > 1.0:
            raise ValueError(f"a KV-cache memory fraction must lie in (0, 1], got {budget}")
        budget = int(budget * free_memory(device))
    elif budget is None:
        budget = int(DEFAULT_FRACTION.get(device.type, 0.25) * free_memory(device))
    return min(budget // per_token, most)


class KVCachePool:
    """Token-major K/V of `capacity` tokens per layer; implements `models.kv_cache.KVCache`.

    Requests are named by id: `allocate(rid, tokens)` gives request `rid` an extent, `base`
    says where it starts, `free` returns it. An unknown or doubly freed id is a
    `CacheSlotError`, a request that cannot fit a `CacheFullError`. `on_move` (optional) is
    told of every compaction move before it is applied (tensor-parallel rank 0 forwards them
    to the other ranks' pools). Extents allocated `evictable` (stored prefix blocks) hold
    rows no request needs: a request that finds no free run of its length takes the run of
    free and evictable rows that evicts the fewest, and only if there is none are they all
    evicted and the pool compacted; `on_evict` (optional) is told which were. An evictable
    extent that requests read is `pin`ned (counted per reader) and is not evicted until the
    last reader `unpin`s it."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        on_move: Callable[[list[Move]], None] | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"a KV pool needs a positive capacity, got {capacity} tokens")
        shape = (capacity, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.bytes_per_token = bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        self.on_move = on_move
        self.on_evict: Callable[[list[int]], None] | None = None
        self._evictable: set[int] = set()  # stored extents no request reads
        self._pins: dict[int, int] = {}  # stored extent -> requests reading it
        self._extents: dict[int, tuple[int, int]] = {}  # request id -> (start, length)
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, length) holes
        self.compactions = 0

    # -- allocation ----------------------------------------------------------------------

    @property
    def free_tokens(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def held_tokens(self) -> int:
        """Rows requests need: their extents and the stored blocks they read."""
        return self.capacity - self.free_tokens - self.evictable_tokens

    @property
    def evictable_tokens(self) -> int:
        return sum(self._extents[rid][1] for rid in self._evictable)

    def allocate(self, request_id: int, tokens: int, *, evictable: bool = False) -> int:
        """Reserves `tokens` contiguous rows for `request_id`; returns the first row. An
        `evictable` extent only ever takes a free run (`CacheFullError` if none fits)."""
        if request_id in self._extents:
            raise CacheSlotError(f"request {request_id} already holds a KV extent")
        if tokens <= 0:
            raise ValueError(f"a KV extent needs a positive length, got {tokens}")
        hole = self._best_fit(tokens)
        if hole is None and evictable:
            raise CacheFullError(f"no free run of {tokens} rows to store a block in")
        available = self.free_tokens + self.evictable_tokens
        if tokens > available:
            raise CacheFullError(
                f"request {request_id} needs {tokens} KV tokens, {available} of "
                f"{self.capacity} are free; raise --kv-cache-memory or admit fewer requests"
            )
        if hole is None:
            hole = self._evict_run(tokens)
        if hole is None:
            self._evict(sorted(self._evictable))
            self._compact()
            hole = len(self._free) - 1  # compaction leaves one hole, at the end
        start, length = self._free[hole]
        if length == tokens:
            del self._free[hole]
        else:
            self._free[hole] = (start + tokens, length - tokens)
        self._extents[request_id] = (start, tokens)
        if evictable:
            self._evictable.add(request_id)
        return start

    def pin(self, extent_id: int) -> None:
        """Counts a reader of evictable extent `extent_id`: it is not evicted while read."""
        if extent_id not in self._evictable and extent_id not in self._pins:
            raise CacheSlotError(f"{extent_id} is not a stored (evictable) extent")
        self._evictable.discard(extent_id)
        self._pins[extent_id] = self._pins.get(extent_id, 0) + 1

    def unpin(self, extent_id: int) -> None:
        """Drops a reader of `extent_id`; with the last one gone it is evictable again."""
        count = self._pins.get(extent_id, 0)
        if not count:
            raise CacheSlotError(f"extent {extent_id} is not pinned")
        if count == 1:
            del self._pins[extent_id]
            self._evictable.add(extent_id)
        else:
            self._pins[extent_id] = count - 1

    def pinned(self, extent_id: int) -> bool:
        return extent_id in self._pins

    def free(self, request_id: int) -> None:
        """Returns `request_id`'s extent; freeing one it does not hold, or one requests
        still read (pinned), is an error."""
        if request_id in self._pins:
            raise CacheSlotError(
                f"extent {request_id} is read by {self._pins[request_id]} requests"
            )
        try:
            start, length = self._extents.pop(request_id)
        except KeyError:
            raise CacheSlotError(f"request {request_id} holds no KV extent") from None
        self._evictable.discard(request_id)
        at = bisect.bisect(self._free, (start, length))
        self._free.insert(at, (start, length))
        self._merge(at)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._extents

    def base(self, request_id: int) -> int:
        """First pool row of `request_id`'s extent (its first position not read from a
        shared prefix)."""
        try:
            return self._extents[request_id][0]
        except KeyError:
            raise CacheSlotError(f"request {request_id} holds no KV extent") from None

    def extent(self, request_id: int) -> tuple[int, int]:
        """(first row, length) of `request_id`'s extent."""
        self.base(request_id)
        return self._extents[request_id]

    def _evict(self, ids: list[int]) -> None:
        for rid in ids:
            self.free(rid)
        if ids and self.on_evict is not None:
            self.on_evict(ids)

    def _evict_run(self, tokens: int) -> int | None:
        """Evicts the evictable extents of the run of adjacent free and evictable rows, at
        least `tokens` long, that evicts the fewest rows; the hole it leaves, if any run
        fits."""
        # (start, length, evictable extent's id or None for a hole), in pool order.
        parts = sorted(
            [(s, n, None) for s, n in self._free]
            + [(*self._extents[rid], rid) for rid in self._evictable]
        )
        best: tuple[int, int, int] | None = None  # (rows evicted, first part, last part)
        lo, length, evicted = 0, 0, 0
        for hi, (start, n, rid) in enumerate(parts):
            if hi > lo and parts[hi - 1][0] + parts[hi - 1][1] != start:  # a held extent
                lo, length, evicted = hi, 0, 0
            length, evicted = length + n, evicted + (n if rid is not None else 0)
            while length - parts[lo][1] >= tokens:  # the shortest run ending at hi
                length -= parts[lo][1]
                evicted -= parts[lo][1] if parts[lo][2] is not None else 0
                lo += 1
            if length >= tokens and (best is None or evicted < best[0]):
                best = (evicted, lo, hi)
        if best is None:
            return None
        self._evict([rid for _, _, rid in parts[best[1] : best[2] + 1] if rid is not None])
        return self._best_fit(tokens)

    def _best_fit(self, tokens: int) -> int | None:
        fits = [(length, i) for i, (_, length) in enumerate(self._free) if length >= tokens]
        return min(fits)[1] if fits else None

    def _merge(self, at: int) -> None:
        """Joins hole `at` with its neighbours where they touch."""
        for i in (at, at - 1):
            if 0 <= i < len(self._free) - 1:
                (s0, n0), (s1, n1) = self._free[i], self._free[i + 1]
                if s0 + n0 == s1:
                    self._free[i : i + 2] = [(s0, n0 + n1)]

    def _compact(self) -> None:
        """Slides every extent down to close the holes between them."""
        moves: list[Move] = []
        cursor = 0
        for rid, (start, length) in sorted(self._extents.items(), key=lambda kv: kv[1][0]):
            if start != cursor:
                moves.append(Move(start, cursor, length))
                self._extents[rid] = (cursor, length)
            cursor += length
        self.copy(moves)
        self._free = [(cursor, self.capacity - cursor)] if cursor < self.capacity else []
        self.compactions += 1

    def copy(self, moves: list[Move]) -> None:
        """Copies rows between extents (compaction, prefix sharing) here and, through
        `on_move`, on every other rank's shard."""
        if not moves:
            return
        if self.on_move is not None:
            self.on_move(moves)
        self.apply_moves(moves)

    def apply_moves(self, moves: list[Move]) -> None:
        """Copies the rows of every move, in order (a compaction's move down, so earlier
        moves never overwrite rows a later one still reads; a prefix copy's between
        disjoint extents)."""
        for move in moves:
            src = slice(move.src, move.src + move.length)
            dst = slice(move.dst, move.dst + move.length)
            for tensor in (*self.keys, *self.values):
                tensor[dst] = (
                    tensor[src].clone() if abs(move.src - move.dst) < move.length else tensor[src]
                )

    # -- the interface the layers use ----------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores fresh `k`, `v` `[n, kv_heads, head_dim]` at pool rows `slots` `[n]`."""
        scatter_kv(self.keys[layer], slots, k)
        scatter_kv(self.values[layer], slots, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V storage of `layer`, `[capacity, kv_heads, head_dim]`."""
        return self.keys[layer], self.values[layer]
