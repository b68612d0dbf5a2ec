"""The packed (variable-length) batch every forward runs on, and attention over it.

A step's rows have different lengths (a recompute row feeds its whole sequence, a cache
row only its block), so their fed tokens are concatenated into one `[T]` sequence with
`cu_seqlens` boundaries instead of being padded to the longest: the linear layers see only
real tokens and no attention mask is needed. Attention runs per row over views — of the
row's own fed K/V, or of its contiguous extent of the KV pool — so nothing is gathered
(save by a row that reads a shared prefix's stored blocks); rows of equal length (and,
when reading the pool, evenly spaced extents) share one batched SDPA call over a strided
view. Grouped-query heads go to SDPA as they are (`enable_gqa`),
never expanded. On CUDA, FlashAttention's varlen kernel runs the self-attention of packed
rows when `flash_attn` is installed (the `flash` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .kv_cache import KVCache

try:  # optional: CUDA only, installed with the `flash` extra
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the installed packages
    flash_attn_varlen_func = None


#: Pool rows as (first row, length) runs, in position order.
Segments = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PackedBatch:
    """One forward: fed tokens `ids` `[T]` with absolute `positions` `[T]`, `lengths` fed
    tokens per row (on the host), and `logits_index` `[R, m]` — indices into the `T` tokens
    of those whose logits are wanted (None: every token, as `[1, T]`).

    With a KV pool, `cache_slots` `[T]` are the pool rows every layer writes the fed K/V to,
    and `cache_reads` — per row, (first pool row, length) — make that row attend over that
    extent of the pool (after the write) instead of over its own fed tokens. With
    `cache_shared`, a row first reads its shared prefix (prefix sharing): per row, the pool
    segments (first row, length) holding its leading positions, its extent the rest."""

    ids: torch.Tensor
    positions: torch.Tensor
    lengths: tuple[int, ...]
    logits_index: torch.Tensor | None = None
    cache_slots: torch.Tensor | None = None
    cache_reads: tuple[tuple[int, int], ...] | None = None
    cache_shared: tuple[Segments, ...] | None = None

    def __post_init__(self) -> None:
        total = sum(self.lengths)
        if self.ids.dim() != 1 or self.positions.shape != self.ids.shape:
            raise ValueError(
                f"ids and positions must both be [T]; got {tuple(self.ids.shape)} and "
                f"{tuple(self.positions.shape)}"
            )
        if total != self.ids.numel() or any(n <= 0 for n in self.lengths):
            raise ValueError(f"row lengths {self.lengths} do not partition {self.ids.numel()}")
        if self.cache_slots is not None and self.cache_slots.shape != self.ids.shape:
            raise ValueError("cache_slots must name one pool row per fed token")
        if self.cache_reads is not None and len(self.cache_reads) != len(self.lengths):
            raise ValueError("cache_reads must give one pool extent per row")
        if self.cache_shared is not None and (
            self.cache_reads is None or len(self.cache_shared) != len(self.lengths)
        ):
            raise ValueError("cache_shared must give one tuple of segments per reading row")

    @property
    def uses_pool(self) -> bool:
        return self.cache_slots is not None or self.cache_reads is not None

    @property
    def key_counts(self) -> tuple[int, ...] | None:
        """Per row, the keys it reads from the pool (shared prefix and extent), if any."""
        if self.cache_reads is None:
            return None
        shared = self.cache_shared or ((),) * len(self.lengths)
        return tuple(
            n + sum(m for _, m in segments)
            for (_, n), segments in zip(self.cache_reads, shared, strict=True)
        )


@dataclass(frozen=True)
class PoolAccess:
    """What a layer does with the pool in one forward (see `PackedBatch`)."""

    pool: KVCache
    slots: torch.Tensor | None
    reads: tuple[tuple[int, int], ...] | None
    shared: tuple[Segments, ...] | None = None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: tuple[int, ...],
    pool: tuple[torch.Tensor, torch.Tensor] | None = None,
    reads: tuple[tuple[int, int], ...] | None = None,
    q_lengths: tuple[int, ...] | None = None,
    masks: list[torch.Tensor] | None = None,
    shared: tuple[Segments, ...] | None = None,
) -> torch.Tensor:
    """Attention of packed queries `q` `[Tq, heads, dim]`: each row over its own `k`, `v`
    `[T, kv_heads, dim]` rows (`lengths` per row), or with `reads` over its extent of the
    pool's `[capacity, kv_heads, dim]` K and V, after the pool segments `shared` names for
    it. Rows have `q_lengths` queries (default: `lengths`, every fed token). Bidirectional,
    unless `masks` gives each row's `[queries, keys]` boolean mask (`block_causal_masks`).
    Returns `[Tq, heads, dim]`."""
    q_lengths = lengths if q_lengths is None else q_lengths
    if reads is not None and pool is not None and shared is not None and any(shared):
        return _attend_segments(q, q_lengths, pool, reads, shared, masks)
    rows = len(lengths)
    stacked = None
    if masks is not None and len({m.shape for m in masks}) == 1:
        stacked = torch.stack(masks)[:, None]
    if reads is not None and pool is not None:
        batched = _even_extents(q_lengths, reads)
        if batched is not None and (masks is None or stacked is not None):
            keys, values = (_strided_rows(t, *batched) for t in pool)
            return _sdpa(_rows(q, rows), keys, values, stacked).reshape(q.shape)
        keys = [pool[0][b : b + n] for b, n in reads]
        values = [pool[1][b : b + n] for b, n in reads]
    else:
        if (
            masks is None
            and flash_attn_varlen_func is not None
            and q.is_cuda
            and q.dtype != torch.float32
        ):
            return _flash_varlen(q, k, v, q_lengths, lengths)
        if (
            len(set(lengths)) == 1
            and len(set(q_lengths)) == 1
            and (masks is None or stacked is not None)
        ):
            return _sdpa(_rows(q, rows), _rows(k, rows), _rows(v, rows), stacked).reshape(q.shape)
        keys, values = list(k.split(lengths)), list(v.split(lengths))
    row_masks = [None] * rows if masks is None else [m[None, None] for m in masks]
    # Out of place, so training (autograd) runs the same path.
    return torch.cat(
        [
            _sdpa(qi[None], ki[None], vi[None], mi)[0]
            for qi, ki, vi, mi in zip(q.split(q_lengths), keys, values, row_masks, strict=True)
        ]
    )


def _attend_segments(
    q: torch.Tensor,
    q_lengths: tuple[int, ...],
    pool: tuple[torch.Tensor, torch.Tensor],
    reads: tuple[tuple[int, int], ...],
    shared: tuple[Segments, ...],
    masks: list[torch.Tensor] | None,
) -> torch.Tensor:
    """Per row, SDPA over its shared prefix segments and then its extent. A row that shares
    nothing reads its extent's view; one that does gathers its keys and values once per
    layer (one copy of rows the pool holds once, freed at once). Scoring each segment in
    place under one softmax, with no copy, was no faster on the CPU (many small calls per
    row) and would keep bf16 scores where SDPA keeps fp32 ones; a paged attention kernel is
    what avoids the copy."""
    out = []
    for i, (qi, (b, n), segments) in enumerate(zip(q.split(q_lengths), reads, shared, strict=True)):
        parts = [*segments, (b, n)]
        k, v = (
            torch.cat([t[s : s + m] for s, m in parts]) if segments else t[b : b + n] for t in pool
        )
        mask = None if masks is None else masks[i][None, None]
        out.append(_sdpa(qi[None], k[None], v[None], mask)[0])
    return torch.cat(out)


def block_causal_masks(
    positions: torch.Tensor,
    lengths: tuple[int, ...],
    key_counts: tuple[int, ...] | None,
    block: int,
    keep: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Per row, the `[queries, keys]` mask of block-causal attention (block diffusion
    models): a token sees every token of its own `block`-long block of absolute positions
    and of the blocks before it. Keys are the row's fed tokens, or with `key_counts` the
    keys it reads from the pool, whose `j`-th holds position `j`; queries are the fed
    tokens, or the ones `keep` `[rows, m]` picks."""
    queries = positions.split(lengths) if keep is None else list(positions[keep])
    if key_counts is None:
        keys = positions.split(lengths)
    else:
        keys = [torch.arange(n, device=positions.device) for n in key_counts]
    return [
        (k // block)[None, :] <= (q // block)[:, None] for q, k in zip(queries, keys, strict=True)
    ]


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`[T, h, d]` of equal-length rows as `[rows, T/rows, h, d]` (a view)."""
    return x.view(rows, -1, *x.shape[1:])


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA on token-major `[b, n, heads, dim]` views (`mask` `[b, 1, n, keys]` or None);
    returns `[b, n, heads, dim]`."""
    gqa = k.shape[2] != q.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa
    )
    return out.transpose(1, 2)


def _even_extents(
    lengths: tuple[int, ...], reads: tuple[tuple[int, int], ...]
) -> tuple[int, int, int, int] | None:
    """(rows, first row, spacing, length) when every row feeds as many tokens and reads an
    equally long extent at an even spacing — one strided view then covers them all."""
    if len(set(lengths)) != 1 or len({n for _, n in reads}) != 1:
        return None
    bases = [b for b, _ in reads]
    spacing = bases[1] - bases[0] if len(bases) > 1 else 0
    if any(b1 - b0 != spacing for b0, b1 in zip(bases, bases[1:], strict=False)):
        return None
    if len(bases) > 1 and spacing <= 0:
        return None  # a view cannot step backwards (torch refuses negative strides)
    return len(bases), bases[0], spacing, reads[0][1]


def _strided_rows(
    store: torch.Tensor, rows: int, first: int, spacing: int, length: int
) -> torch.Tensor:
    """`[rows, length, kv_heads, dim]` view of extents `first + i * spacing` of `store`."""
    token = store.stride(0)
    return store.as_strided(
        (rows, length, *store.shape[1:]),
        (spacing * token, token, *store.stride()[1:]),
        store.storage_offset() + first * token,
    )


def _flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lengths: tuple[int, ...],
    lengths: tuple[int, ...],
) -> torch.Tensor:
    def cu(n: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor((0, *n), device=q.device, dtype=torch.int32).cumsum(
            0, dtype=torch.int32
        )

    return flash_attn_varlen_func(
        q, k, v, cu(q_lengths), cu(lengths), max(q_lengths), max(lengths), causal=False
    )
