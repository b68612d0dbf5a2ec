"""The model calls of one step, as plain tensors: what rank 0 of a tensor-parallel
instance broadcasts to the other ranks, and what every rank runs.

A step has at most two groups of rows (full-sequence rows and cache-step rows), each one
model call. Describing them as data rather than runner state is what lets the other ranks
hold no request state of their own: they receive the groups and run them on their shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dilaserve.models.kv_cache import KVCache
from dilaserve.models.model import CacheAccessMode, DiffusionLM


@dataclass
class ForwardGroup:
    """One model call: right-padded fed tokens `ids` `[b, n]` with absolute `positions` and
    `valid` flags, the fed tokens whose logits are wanted (`logits_index` `[b, m]`), and
    how the call uses the KV pool (slots `cache_rows` `[b]`; `cache_len` `[b]` when it
    reads)."""

    ids: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    logits_index: torch.Tensor
    cache_mode: CacheAccessMode = "off"
    cache_rows: torch.Tensor | None = None
    cache_len: torch.Tensor | None = None


def forward_logits(
    model: DiffusionLM, pool: KVCache | None, groups: Sequence[ForwardGroup]
) -> torch.Tensor:
    """Runs every group and returns this rank's logits `[rows, width, local_vocab]`, rows in
    group order, with the mask token unscorable (committing it would leave a position
    masked)."""
    outputs = [
        model(
            g.ids,
            g.positions,
            g.valid,
            logits_index=g.logits_index,
            cache=None if g.cache_mode == "off" else pool,
            cache_rows=g.cache_rows,
            cache_mode=g.cache_mode,
            cache_len=g.cache_len,
        )
        for g in groups
    ]
    logits = stack_rows(outputs)
    mask = model.config.mask_token_id - model.vocab_offset
    if 0 <= mask < logits.shape[-1]:
        logits[..., mask] = float("-inf")
    return logits


def stack_rows(groups: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenates `[b, width, vocab]` logits of step groups whose widest block differs;
    the padding columns lie outside every row's block, so they are never candidates."""
    if len(groups) == 1:
        return groups[0]
    width = max(g.shape[1] for g in groups)
    return torch.cat([F.pad(g, (0, 0, 0, width - g.shape[1])) for g in groups])
