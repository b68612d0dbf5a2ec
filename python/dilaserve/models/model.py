"""`DiffusionLM`: the one module behind every family, implementing the worker's forward.

Families differ only in configuration (biases, tied head, head width) and in tensor
names, which `Family` translates at load and save time. Built with a tensor-parallel group,
the module is one rank's shard (`parallel`): same parameter names, smaller tensors, and
logits for the rank's vocabulary shard only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import DecoderLayer, RMSNorm, rope_tables
from .packed import PackedBatch, PoolAccess, block_causal_masks
from .parallel import Collective, Shard, VocabParallelEmbedding, check_degree

if TYPE_CHECKING:
    from .kv_cache import KVCache

# How one forward uses the KV pool (an instance's cache policy is `protocol.CacheMode`).
CacheAccessMode = Literal["off", "write", "read"]


class DiffusionLM(nn.Module):
    """Transformer returning per-position vocabulary logits: bidirectional, or block-causal
    for block diffusion models (`config.block_size`)."""

    def __init__(self, config: ModelConfig, group: Collective | None = None) -> None:
        super().__init__()
        if group is not None and group.world_size == 1:
            group = None
        shard = Shard.of(group)
        check_degree(config, shard.world_size)
        self.config = config
        self.group = group
        self.shard = shard
        rows = config.embedding_rows // shard.world_size
        #: This rank's vocabulary shard: token ids `[vocab_offset, vocab_offset + local_vocab)`
        #: (embedding rows past `vocab_size` are padding, never scored).
        self.vocab_offset = shard.rank * rows
        self.local_vocab = max(0, min(rows, config.vocab_size - self.vocab_offset))
        self.embed = (
            nn.Embedding(rows, config.hidden_size)
            if group is None
            else VocabParallelEmbedding(rows, config.hidden_size, self.vocab_offset, group)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, group, index) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_bias)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, rows, bias=config.linear_bias)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank computes and caches."""
        return self.config.num_kv_heads // self.shard.world_size

    def forward(
        self,
        batch: PackedBatch | torch.Tensor,
        positions: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        *,
        logits_index: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_base: torch.Tensor | None = None,
        cache_mode: CacheAccessMode = "off",
        cache_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[rows, m, local_vocab]` (the whole vocabulary on one rank, the rank's
        shard under tensor parallelism).

        The worker passes a `PackedBatch` (and `cache` when it uses the KV pool). The
        padded form — `input_ids` `[b, n]` with absolute `positions` and a right-padding
        `valid` mask, `logits_index` `[b, m]` into each row's fed tokens — is packed first:
        `"write"` stores every layer's K/V at pool rows `cache_base[i] + position`,
        `"read"` does so too and then attends over pool rows `cache_base[i] +
        [0, cache_len[i])`. The model applies no logit shift: for Dream
        (`config.logit_shift == 1`) the caller asks for the token before each position it
        wants predicted.
        """
        if isinstance(batch, PackedBatch):
            return self._forward_packed(batch, cache)
        if positions is None or valid is None:
            raise ValueError("a padded forward needs positions and valid")
        packed = pack_padded(
            batch, positions, valid, logits_index, cache_mode, cache_base, cache_len
        )
        return self._forward_packed(packed, None if cache_mode == "off" else cache)

    def _forward_packed(self, batch: PackedBatch, cache: KVCache | None) -> torch.Tensor:
        if batch.uses_pool and cache is None:
            raise ValueError("a forward that writes or reads the KV pool needs the pool")
        access = (
            PoolAccess(cache, batch.cache_slots, batch.cache_reads, batch.cache_shared)
            if batch.uses_pool
            else None
        )
        x = self.embed(batch.ids)
        if self.config.input_scale != 1.0:
            x = x * self.config.input_scale
        config = self.config
        rope = rope_tables(batch.positions, config.rotary_dim or config.head_dim, config.rope_theta)
        keep = batch.logits_index
        masks = masks_keep = None
        if config.block_size:
            key_counts = batch.key_counts
            masks = block_causal_masks(
                batch.positions, batch.lengths, key_counts, config.block_size
            )
            if keep is not None:
                masks_keep = block_causal_masks(
                    batch.positions, batch.lengths, key_counts, config.block_size, keep
                )
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            # Only the tokens whose logits are wanted need the last layer's queries and MLP.
            if index == last and keep is not None:
                x = layer(x, rope, batch.lengths, index, access, keep, masks_keep)
            else:
                x = layer(x, rope, batch.lengths, index, access, None, masks)
        x = x[None] if keep is None else x.view(*keep.shape, -1)
        return self._logits(self.norm(x))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed if self.lm_head is None else self.lm_head
        # Embedding rows past vocab_size are padding, never tokens: no logits for them.
        vocab = self.local_vocab
        bias = None if getattr(head, "bias", None) is None else head.bias[:vocab]
        logits = F.linear(hidden, head.weight[:vocab], bias)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        return logits


def pack_padded(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    logits_index: torch.Tensor | None,
    cache_mode: CacheAccessMode,
    cache_base: torch.Tensor | None,
    cache_len: torch.Tensor | None,
) -> PackedBatch:
    """The packed batch of a padded forward: each row's valid tokens, in order."""
    if input_ids.dim() != 2 or positions.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and positions must both be [b, n]; got {tuple(input_ids.shape)} "
            f"and {tuple(positions.shape)}"
        )
    if valid.shape != input_ids.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool [b, n] tensor; got {valid.dtype} {valid.shape}")
    b, n = input_ids.shape
    # A row of pure padding feeds its first token: its logits are meaningless but finite
    # and never mix into other rows.
    valid = valid | (~valid.any(dim=1, keepdim=True) & (torch.arange(n, device=valid.device) == 0))
    lengths = valid.sum(dim=1)
    if logits_index is None:
        logits_index = torch.arange(n, device=input_ids.device).expand(b, n)
    # Packed index of each padded column: its rank among the row's valid columns (a
    # padding column maps to the valid one before it, or the row's first).
    rank = (valid.cumsum(dim=1) - 1).clamp(min=0)
    index = (torch.cumsum(lengths, 0) - lengths)[:, None] + rank.gather(1, logits_index)
    slots = reads = None
    if cache_mode not in ("off", "write", "read"):
        raise ValueError(f"cache_mode must be 'off', 'write' or 'read', not {cache_mode!r}")
    if cache_mode != "off":
        if cache_base is None:
            raise ValueError(f"cache_mode={cache_mode!r} needs cache and cache_base")
        slots = (cache_base[:, None] + positions)[valid]
    if cache_mode == "read":
        if cache_len is None:
            raise ValueError("cache_mode='read' needs cache_len")
        reads = tuple(zip(cache_base.tolist(), cache_len.tolist(), strict=True))  # type: ignore[union-attr]
    return PackedBatch(
        input_ids[valid], positions[valid], tuple(lengths.tolist()), index, slots, reads
    )
