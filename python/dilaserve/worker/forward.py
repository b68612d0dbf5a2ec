"""The model call of one step, as plain tensors: what rank 0 of a tensor-parallel instance
broadcasts to the other ranks (`step_plan`), and what every rank runs.

A step is one packed model call over every row, whatever its step kind: describing it as
data rather than runner state is what lets the other ranks hold no request state of their
own — they receive the batch and run it on their shard.
"""

from __future__ import annotations

import torch

from dilaserve.models.kv_cache import KVCache
from dilaserve.models.model import DiffusionLM
from dilaserve.models.packed import PackedBatch


def forward_logits(model: DiffusionLM, pool: KVCache | None, batch: PackedBatch) -> torch.Tensor:
    """Runs the step's model call and returns this rank's logits `[rows, width,
    local_vocab]`, with the mask token unscorable (committing it would leave a position
    masked)."""
    logits = model(batch, cache=pool if batch.uses_pool else None)
    mask = model.config.mask_token_id - model.vocab_offset
    if 0 <= mask < logits.shape[-1]:
        logits[..., mask] = float("-inf")
    return logits
