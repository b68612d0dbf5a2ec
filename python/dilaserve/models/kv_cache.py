"""The KV-cache interface the model layers use. The worker owns the storage (its pool
implements this protocol); models only call `write` and `layer`, so they never import it."""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores fresh `k`, `v` `[n, kv_heads, head_dim]` at pool rows `slots` `[n]`."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The token-major K and V storage of `layer`: `[capacity, kv_heads, head_dim]`."""
        ...
