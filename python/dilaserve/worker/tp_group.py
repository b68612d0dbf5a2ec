"""One rank's membership in a tensor-parallel instance (DESIGN §10): `torch.distributed`
with NCCL on CUDA and gloo on the CPU, one device per rank.

Two process groups: the model's collectives (all-reduce in the row-parallel layers and the
embedding, the gather of vocabulary partials) run on the device group; the step plan that
rank 0 broadcasts runs on a gloo group of its own, on the CPU, whose timeout is long enough
for an instance to sit idle for weeks while the other ranks wait for their next step.

Every failed collective becomes `GroupLostError`: a group with a dead or hung rank cannot
be used again, so the instance goes down as a whole.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from dilaserve.models.packed import PackedBatch
from dilaserve.worker.errors import GroupLostError
from dilaserve.worker.kv_cache import Move
from dilaserve.worker.step_plan import (
    HEADER_LEN,
    PlanMessage,
    PlanOp,
    body_length,
    header,
    pack_moves,
    pack_step,
    unpack,
)

log = logging.getLogger(__name__)

#: How long a model collective may wait for the slowest rank.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
#: How long the other ranks may wait for rank 0's next plan (an idle instance).
PLAN_TIMEOUT = timedelta(days=30)

T = TypeVar("T")


@dataclass
class CommStats:
    """Where this rank's communication went (wall time is measured on the host: exact on
    the CPU, the launch time only for asynchronous NCCL calls)."""

    all_reduce_calls: int = 0
    all_reduce_seconds: float = 0.0
    all_reduce_bytes: int = 0
    #: Bytes this rank contributed to vocabulary-parallel commits, and their positions.
    commit_bytes: int = 0
    commit_positions: int = 0
    plan_bytes: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """This process's rank in a group of `world_size` processes; implements the models'
    `Collective` protocol. Every rank must create it (it is a collective call)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        device: str | torch.device = "cpu",
        *,
        timeout: timedelta = COLLECTIVE_TIMEOUT,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._guard(
            dist.init_process_group,
            backend_for(self.device),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        self._plan_group = self._guard(dist.new_group, backend="gloo", timeout=PLAN_TIMEOUT)
        self._rank = rank
        self._world_size = world_size
        self.stats = CommStats()
        log.info("rank %d of %d joined (%s)", rank, world_size, backend_for(self.device))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # -- model collectives ---------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        self._guard(dist.all_reduce, tensor)
        s = self.stats
        s.all_reduce_seconds += time.perf_counter() - started
        s.all_reduce_calls += 1
        s.all_reduce_bytes += tensor.numel() * tensor.element_size()

    def gather_partials(self, partials: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `[b, m, 3]` vocabulary partials, stacked `[world, b, m, 3]` on rank
        0 (None elsewhere): the only per-position data the commit exchanges."""
        into = self._gather_commit(partials.contiguous())
        return None if into is None else torch.stack(into)

    def gather_logits(self, logits: torch.Tensor, shard_width: int) -> torch.Tensor | None:
        """The whole vocabulary's `[b, m, world × shard_width]` logits on rank 0 (None
        elsewhere), each rank's shard padded to `shard_width` with -inf: only for steps with
        rows scored over every logit."""
        local = torch.full(
            (*logits.shape[:-1], shard_width), -math.inf, dtype=logits.dtype, device=logits.device
        )
        local[..., : logits.shape[-1]] = logits
        into = self._gather_commit(local)
        return None if into is None else torch.cat(into, dim=-1)

    def _gather_commit(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `[b, m, ...]` commit data on rank 0 (None elsewhere), counted."""
        into = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        self._guard(dist.gather, local, into, dst=0)
        self.stats.commit_bytes += local.numel() * local.element_size()
        self.stats.commit_positions += local.shape[0] * local.shape[1]
        return into

    # -- the step plan (rank 0 sends, the others receive) --------------------------------

    def send_step(self, batch: PackedBatch, full_logits: bool = False) -> None:
        self._send(*pack_step(batch, full_logits))

    def send_pool(self, capacity: int) -> None:
        """The other ranks allocate a KV pool of `capacity` tokens (0: none)."""
        self._send(header(PlanOp.POOL, capacity), None)

    def send_moves(self, moves: list[Move]) -> None:
        """The other ranks apply rank 0's pool compaction to their pools."""
        self._send(*pack_moves(moves))

    def stop_followers(self) -> None:
        """Tells the other ranks to leave; rank 0 only."""
        self._send(header(PlanOp.STOP), None)

    def receive(self) -> PlanMessage:
        """Waits for rank 0's next plan."""
        head = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._guard(dist.broadcast, head, src=0, group=self._plan_group)
        length = body_length(head)
        body = torch.empty(length, dtype=torch.int64)
        if length:
            self._guard(dist.broadcast, body, src=0, group=self._plan_group)
        return unpack(head, body, self.device)

    def _send(self, head: torch.Tensor, body: torch.Tensor | None) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends step plans")
        self._guard(dist.broadcast, head, src=0, group=self._plan_group)
        if body is not None and body.numel():
            self._guard(dist.broadcast, body, src=0, group=self._plan_group)
        self.stats.plan_bytes += 8 * (head.numel() + (0 if body is None else body.numel()))

    # -- life cycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Leaves the group (best effort: a peer may already be gone)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError) as exc:
                log.debug("leaving the group: %s", exc)

    @staticmethod
    def _guard(call: Callable[..., T], *args: object, **kwargs: object) -> T:
        try:
            return call(*args, **kwargs)
        except RuntimeError as exc:  # gloo and NCCL report a lost peer as RuntimeError
            raise GroupLostError(f"tensor-parallel group lost: {exc}") from exc
