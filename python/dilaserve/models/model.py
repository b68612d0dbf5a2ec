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
from .layers import CacheAccess, DecoderLayer, RMSNorm, rope_tables
from .parallel import Collective, Shard, VocabParallelEmbedding, check_degree

if TYPE_CHECKING:
    from .kv_cache import KVCache

# How one forward uses the KV pool (an instance's cache policy is `protocol.CacheMode`).
CacheAccessMode = Literal["off", "write", "read"]


class DiffusionLM(nn.Module):
    """Bidirectional transformer returning per-position vocabulary logits."""

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
        self.layers = nn.ModuleList(DecoderLayer(config, group) for _ in range(config.num_layers))
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
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        *,
        logits_index: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_rows: torch.Tensor | None = None,
        cache_mode: CacheAccessMode = "off",
        cache_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[b, m, local_vocab]` for the fed tokens `input_ids` `[b, n]` (the whole
        vocabulary on one rank, the rank's shard under tensor parallelism).

        `positions` `[b, n]` are absolute sequence positions (RoPE and cache index); `valid`
        `[b, n]` marks real entries. `"off"` attends among the row's valid fed tokens;
        `"write"` does the same and stores every layer's K/V in slots `cache_rows`;
        `"read"` stores them too, then attends over the slots' first `cache_len[i]`
        positions. `logits_index` `[b, m]` picks which fed tokens get logits (all if None).
        The model applies no logit shift: for Dream (`config.logit_shift == 1`) the caller
        asks for the token before each position it wants predicted.
        """
        access, key_mask = self._attention_inputs(
            input_ids, positions, valid, cache, cache_rows, cache_mode, cache_len
        )
        x = self.embed(input_ids)
        if self.config.input_scale != 1.0:
            x = x * self.config.input_scale
        rope = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, key_mask, index, access)
        if logits_index is not None:
            x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
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

    def _attention_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        cache: KVCache | None,
        cache_rows: torch.Tensor | None,
        cache_mode: CacheAccessMode,
        cache_len: torch.Tensor | None,
    ) -> tuple[CacheAccess | None, torch.Tensor | None]:
        """The cache access of this forward and the boolean key mask `[b, 1, 1, keys]`."""
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [b, n]; got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if valid.shape != input_ids.shape or valid.dtype != torch.bool:
            raise ValueError(f"valid must be a bool [b, n] tensor; got {valid.dtype} {valid.shape}")
        if cache_mode == "off":
            return None, _key_mask(valid[:, None, None, :])
        if cache_mode not in ("write", "read"):
            raise ValueError(f"cache_mode must be 'off', 'write' or 'read', not {cache_mode!r}")
        if cache is None or cache_rows is None:
            raise ValueError(f"cache_mode={cache_mode!r} needs cache and cache_rows")
        if cache_mode == "write":
            return CacheAccess(cache, cache_rows, positions, valid, None), _key_mask(
                valid[:, None, None, :]
            )
        if cache_len is None:
            raise ValueError("cache_mode='read' needs cache_len")
        length = int(cache_len.max())
        keys = torch.arange(length, device=cache_len.device)[None, :] < cache_len[:, None]
        return CacheAccess(cache, cache_rows, positions, valid, length), _key_mask(
            keys[:, None, None, :]
        )


def _key_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """The attention mask for `mask` `[b, 1, 1, keys]`: None when every key is visible (the
    unmasked attention path is faster). A row with no key at all (pure padding) attends to
    every key instead of producing NaN; its outputs are meaningless but finite and never mix
    into other rows."""
    if bool(mask.all()):
        return None
    return mask | ~mask.any(dim=-1, keepdim=True)
