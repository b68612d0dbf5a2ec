"""The packed (variable-length) batch every forward runs on, and attention over it.

A step's rows have different lengths (a recompute row feeds its whole sequence, a cache
row only its block), so their fed tokens are concatenated into one `[T]` sequence with
`cu_seqlens` boundaries instead of being padded to the longest: the linear layers see only
real tokens and no attention mask is needed. Attention runs per row over views — of the
row's own fed K/V, or of its contiguous extent of the KV pool — so nothing is gathered;
rows of equal length (and, when reading the pool, evenly spaced extents) share one batched
SDPA call over a strided view. Grouped-query heads go to SDPA as they are (`enable_gqa`),
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
    """Per row, attention over its shared prefix segments and then its extent. A row that
    shares nothing runs SDPA on its extent's view. One that does reads the segments in place
    (`_sdpa_segments`) when its queries are few (a block) and the pool is fp32; otherwise
    (a prefill's many queries, whose scores would be large; bf16/fp16, where SDPA keeps the
    scores in fp32 and a row's numerics stay those of an unshared row) its keys and values
    are gathered once per layer and go to SDPA."""
    out = []
    for i, (qi, (b, n), segments) in enumerate(zip(q.split(q_lengths), reads, shared, strict=True)):
        row_mask = None if masks is None else masks[i]
        parts = [*segments, (b, n)]
        keys = [pool[0][s : s + m] for s, m in parts]
        values = [pool[1][s : s + m] for s, m in parts]
        if len(parts) > 1 and qi.shape[0] <= SEGMENT_QUERIES and qi.dtype == torch.float32:
            out.append(_sdpa_segments(qi, keys, values, row_mask))
            continue
        k, v = (torch.cat(t) if len(t) > 1 else t[0] for t in (keys, values))
        mask = None if row_mask is None else row_mask[None, None]
        out.append(_sdpa(qi[None], k[None], v[None], mask)[0])
    return torch.cat(out)


#: Most queries a row reads shared segments in place with (`_sdpa_segments` holds its
#: `[heads, queries, keys]` scores): a block's steps; a prefill gathers instead.
SEGMENT_QUERIES = 64


def _sdpa_segments(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of one row's queries `q` `[n, heads, dim]` over keys and values held in
    several `[m_i, kv_heads, dim]` pool segments, without copying them together: each
    segment's scores, one softmax over all of them (with `mask` `[n, sum m_i]`), and the sum
    of each segment's weighted values. Queries are few (`SEGMENT_QUERIES`), so the scores
    are small."""
    n, heads, dim = q.shape
    kv_heads = keys[0].shape[1]
    grouped = q.view(n, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)  # [kvh, g, n, d]
    scores = torch.cat([grouped @ k.permute(1, 2, 0)[:, None] for k in keys], dim=-1)
    scores = scores.float() * dim**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = sum(
        p @ v.permute(1, 0, 2)[:, None]
        for p, v in zip(probs.split([k.shape[0] for k in keys], dim=-1), values, strict=True)
    )
    return out.permute(2, 0, 1, 3).reshape(n, heads, dim)  # type: ignore[union-attr]


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
