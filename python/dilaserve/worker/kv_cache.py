"""Per-request K/V slots for approximate KV caching (Fast-dLLM prefix / dual cache).

Every request that runs with a cache owns one slot for its whole life on this worker. A
slot holds, per layer, K and V for every position of the request's sequence. Batch rows are
mapped to slots explicitly (`rows`), and writes go to per-row positions, so rows of
different lengths and step kinds never touch each other's entries.
"""

from __future__ import annotations

import torch

from dilaserve.kernels import gather_kv, scatter_kv
from dilaserve.worker.errors import CacheFullError


class KVCachePool:
    """K/V storage of shape `[slots, kv_heads, max_len, head_dim]` per layer; implements
    `models.kv_cache.KVCache`, the interface the model layers use."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError("no free KV-cache slot; raise num_slots or admit fewer requests")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def write(
        self,
        layer: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Stores fresh `k`, `v` `[b, kv_heads, n, head_dim]` at `positions` `[b, n]` of slots
        `rows` `[b]`; entries where `valid` `[b, n]` is false are left untouched."""
        scatter_kv(self.keys[layer], rows, positions, valid, k)
        scatter_kv(self.values[layer], rows, positions, valid, v)

    def read(
        self, layer: int, rows: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots `rows`, positions `[0, length)`: `[b, kv_heads, length, head_dim]`."""
        return (
            gather_kv(self.keys[layer], rows, length),
            gather_kv(self.values[layer], rows, length),
        )
