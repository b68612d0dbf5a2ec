"""The packed step plan a tensor-parallel rank 0 broadcasts: what is sent is what the
other ranks run."""

from __future__ import annotations

import pytest
import torch

from dilaserve.models.packed import PackedBatch
from dilaserve.worker.kv_cache import Move
from dilaserve.worker.step_plan import (
    PlanOp,
    body_length,
    header,
    pack_moves,
    pack_step,
    unpack,
)


def _round_trip(head: torch.Tensor, body: torch.Tensor):
    assert body_length(head) == body.numel()
    return unpack(head, body, torch.device("cpu"))


@pytest.mark.parametrize("shared", [None, (((8, 16), (40, 8)), ()), ((), ((0, 8),))])
def test_a_step_reading_the_pool_round_trips(shared):
    batch = PackedBatch(
        ids=torch.tensor([5, 6, 7, 8, 9]),
        positions=torch.tensor([0, 1, 2, 40, 41]),
        lengths=(3, 2),
        logits_index=torch.tensor([[1, 2], [3, 3]]),
        cache_slots=torch.tensor([100, 101, 102, 240, 241]),
        cache_reads=((100, 3), (200, 42)),
        cache_shared=shared,
    )
    got = _round_trip(*pack_step(batch)).batch
    assert got is not None
    for name in ("ids", "positions", "logits_index", "cache_slots"):
        assert torch.equal(getattr(got, name), getattr(batch, name)), name
    assert got.lengths == batch.lengths and got.cache_reads == batch.cache_reads
    assert got.cache_shared == shared


def test_a_step_without_the_pool_round_trips():
    batch = PackedBatch(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), (3,))
    message = _round_trip(*pack_step(batch))
    got = message.batch
    assert got is not None and got.cache_slots is None and got.cache_reads is None
    assert torch.equal(got.logits_index, torch.arange(3)[None])
    assert not message.full_logits
    assert _round_trip(*pack_step(batch, full_logits=True)).full_logits


def test_pool_and_moves_round_trip():
    message = _round_trip(header(PlanOp.POOL, 4096), torch.empty(0, dtype=torch.int64))
    assert message.op is PlanOp.POOL and message.pool_capacity == 4096
    moves = [Move(30, 0, 10), Move(50, 10, 5)]
    message = _round_trip(*pack_moves(moves))
    assert message.op is PlanOp.MOVE and list(message.moves) == moves
