"""Approximate KV reuse: per-row scatter of fresh K/V into cache slots and slot gather.

(Placeholder torch reference; the Triton kernels and dispatcher replace these.)
"""

from __future__ import annotations

import torch


def scatter_kv(
    cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    new: torch.Tensor,
) -> None:
    """cache[rows[i], :, positions[i, j], :] = new[i, :, j, :] where valid[i, j]."""
    b, n = positions.shape
    row_idx = rows[:, None].expand(b, n)[valid]
    pos_idx = positions[valid]
    cache[row_idx, :, pos_idx, :] = new.permute(0, 2, 1, 3)[valid].to(cache.dtype)


def gather_kv(cache: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """cache[rows, :, :length, :]."""
    return cache.index_select(0, rows)[:, :, :length, :]
