"""The KV-cache interface the model layers use. The worker owns the storage (its pool
implements this protocol); models only call `write` and `read`, so they never import it."""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    def write(
        self,
        layer: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Stores fresh `k`, `v` `[b, kv_heads, n, head_dim]` at `positions` `[b, n]` of
        cache rows `rows` `[b]`; entries where `valid` is false are left untouched."""

    def read(
        self, layer: int, rows: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of cache rows `rows`, positions `[0, length)`."""
        ...
