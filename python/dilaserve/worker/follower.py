"""What the ranks other than 0 of a tensor-parallel instance do: run the step plans rank 0
broadcasts on their shard of the model and contribute their vocabulary partials (their
logit shards, for a step with rows scored over every logit).

They hold no request state at all — no token state, no extent bookkeeping — only their
part of every layer's weights and their heads of the KV pool; rank 0's runner decides every
pool row, and replays its compactions to them (`PlanOp.MOVE`), so the pools of all ranks
stay in step by construction.
"""

from __future__ import annotations

import logging

import torch

from dilaserve.kernels import combine_vocab_partials, vocab_partials
from dilaserve.models.model import DiffusionLM
from dilaserve.worker.forward import forward_logits
from dilaserve.worker.kv_cache import KVCachePool
from dilaserve.worker.step_plan import PlanOp
from dilaserve.worker.tp_group import TensorParallelGroup

log = logging.getLogger(__name__)


def make_pool(model: DiffusionLM, capacity: int) -> KVCachePool | None:
    """The KV pool of this rank's heads (None for 0 tokens: an instance without a cache)."""
    if capacity <= 0:
        return None
    return KVCachePool(
        num_layers=model.config.num_layers,
        capacity=capacity,
        num_kv_heads=model.local_kv_heads,
        head_dim=model.config.head_dim,
        dtype=model.dtype,
        device=model.device,
    )


@torch.inference_mode()
def follow(model: DiffusionLM, group: TensorParallelGroup) -> None:
    """Executes rank 0's plans until it says stop (a lost group raises `GroupLostError`)."""
    pool: KVCachePool | None = None
    steps = 0
    while True:
        message = group.receive()
        if message.op is PlanOp.STOP:
            log.info("rank %d leaves after %d steps", group.rank, steps)
            return
        if message.op is PlanOp.POOL:
            pool = None  # free the old pool before allocating the new one
            pool = make_pool(model, message.pool_capacity)
            continue
        if message.op is PlanOp.MOVE:
            if pool is not None:
                pool.apply_moves(list(message.moves))
            continue
        if message.batch is None:
            raise RuntimeError("a step plan without a batch")
        logits = forward_logits(model, pool, message.batch)
        if message.full_logits:
            group.gather_logits(logits, vocab_shard_width(model))
        else:
            group.gather_partials(vocab_partials(logits, model.vocab_offset))
        steps += 1


def vocab_shard_width(model: DiffusionLM) -> int:
    """Vocabulary rows of every rank's shard (the last rank's real ones may be fewer)."""
    return model.config.embedding_rows // model.shard.world_size


def full_vocab_logits(
    model: DiffusionLM, group: TensorParallelGroup, logits: torch.Tensor
) -> torch.Tensor:
    """Rank 0's half of a step with rows scored over every logit: the shards of every rank
    joined into `[b, m, vocab]`."""
    gathered = group.gather_logits(logits, vocab_shard_width(model))
    if gathered is None:
        raise RuntimeError("only rank 0 joins the logit shards")
    return gathered[..., : model.config.vocab_size]


def vocab_parallel_scores(
    model: DiffusionLM, group: TensorParallelGroup, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's half of the commit: argmax ids and confidences `[b, m]` over the whole
    vocabulary from every rank's partials — 12 bytes per position and rank, never logits."""
    gathered = group.gather_partials(vocab_partials(logits, model.vocab_offset))
    if gathered is None:
        raise RuntimeError("only rank 0 combines vocabulary partials")
    return combine_vocab_partials(gathered)
