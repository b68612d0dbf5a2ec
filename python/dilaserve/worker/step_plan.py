"""The packed step plan rank 0 of a tensor-parallel instance broadcasts to the other
ranks: a fixed-size int64 header saying what to do, then one int64 body holding every
tensor of the step's model call back to back.

Packed records rather than pickled objects: two broadcasts of flat tensors per step, no
Python objects on the wire, and a receiver that knows the body's size from the header.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

from dilaserve.models.packed import PackedBatch
from dilaserve.worker.kv_cache import Move

#: int64 slots of a header: op, then (rows, fed tokens, logits width, pool access, full
#: logits, shared prefix segments) for a step, the capacity for a pool, the move count for
#: a compaction.
HEADER_LEN = 8


class PlanOp(enum.IntEnum):
    """What the other ranks do next."""

    STEP = 1  # run the step's model call and contribute vocabulary partials (or logits)
    POOL = 2  # (re)allocate the KV pool: header holds its capacity in tokens (0: none)
    STOP = 3  # leave the group
    MOVE = 4  # apply a compaction of the KV pool: body holds (src, dst, length) triples


class Access(enum.IntEnum):
    """How a step's model call uses the KV pool."""

    OFF = 0
    WRITE = 1  # write the fed K/V, attend over the fed tokens
    READ = 2  # write the fed K/V, attend over each row's pool extent


@dataclass(frozen=True)
class PlanMessage:
    op: PlanOp
    batch: PackedBatch | None = None
    #: The step's rows include one scored over every logit (temperature sampling, Dream's
    #: alg): the ranks send their logit shards, not partials.
    full_logits: bool = False
    pool_capacity: int = 0
    moves: tuple[Move, ...] = ()


def header(op: PlanOp, *values: int) -> torch.Tensor:
    out = torch.zeros(HEADER_LEN, dtype=torch.int64)
    out[0] = int(op)
    out[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return out


def access_of(batch: PackedBatch) -> Access:
    if batch.cache_reads is not None:
        return Access.READ
    return Access.WRITE if batch.cache_slots is not None else Access.OFF


def pack_step(batch: PackedBatch, full_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, body) of a step; both on the CPU."""
    rows, tokens = len(batch.lengths), batch.ids.numel()
    index = batch.logits_index
    if index is None:
        index = torch.arange(tokens)[None]
    access = access_of(batch)
    parts = [batch.ids, batch.positions, torch.tensor(batch.lengths), index]
    if access is Access.READ and batch.cache_slots is None:
        raise ValueError("a step that reads the KV pool also writes its fed tokens")
    if access is not Access.OFF:
        parts.append(batch.cache_slots)  # type: ignore[arg-type]
    if access is Access.READ:
        parts.append(torch.tensor(batch.cache_reads).reshape(-1))
    segments = sum(len(row) for row in batch.cache_shared or ())
    if segments:  # per row its count of shared segments, then all of them
        shared = batch.cache_shared or ()
        parts.append(torch.tensor([len(row) for row in shared]))
        parts.append(torch.tensor([x for row in shared for seg in row for x in seg]))
    body = torch.cat([p.reshape(-1).to(device="cpu", dtype=torch.int64) for p in parts])
    head = header(
        PlanOp.STEP, rows, tokens, index.shape[1], int(access), int(full_logits), segments
    )
    return head, body


def pack_moves(moves: list[Move]) -> tuple[torch.Tensor, torch.Tensor]:
    body = torch.tensor([(m.src, m.dst, m.length) for m in moves], dtype=torch.int64)
    return header(PlanOp.MOVE, len(moves)), body.reshape(-1)


def body_length(head: torch.Tensor) -> int:
    """int64 entries of the body that follows `head`."""
    op = PlanOp(int(head[0]))
    if op is PlanOp.MOVE:
        return 3 * int(head[1])
    if op is not PlanOp.STEP:
        return 0
    rows, tokens, width, access = (int(x) for x in head[1:5])
    segments = int(head[6])
    shared = rows + 2 * segments if segments else 0
    return (
        2 * tokens + rows + rows * width + tokens * (access > 0) + 2 * rows * (access == 2) + shared
    )


def unpack(head: torch.Tensor, body: torch.Tensor, device: torch.device) -> PlanMessage:
    """The message of a received (header, body), tensors on `device`."""
    op = PlanOp(int(head[0]))
    if op is PlanOp.POOL:
        return PlanMessage(op, pool_capacity=int(head[1]))
    if op is PlanOp.MOVE:
        triples = body.view(-1, 3).tolist()
        return PlanMessage(op, moves=tuple(Move(*t) for t in triples))
    if op is PlanOp.STOP:
        return PlanMessage(op)
    rows, tokens, width, access, full_logits, segments = (int(x) for x in head[1:7])
    lengths = body[2 * tokens : 2 * tokens + rows].tolist()
    reads = shared = None
    reads_at = 2 * tokens + rows + rows * width + tokens * (access > 0)
    if access == Access.READ:
        flat = body[reads_at : reads_at + 2 * rows].tolist()
        reads = tuple(zip(flat[::2], flat[1::2], strict=True))
    if segments:
        at = reads_at + 2 * rows
        counts = body[at : at + rows].tolist()
        flat = body[at + rows : at + rows + 2 * segments].tolist()
        pairs = list(zip(flat[::2], flat[1::2], strict=True))
        ends = list(itertools.accumulate(counts))
        shared = tuple(tuple(pairs[end - n : end]) for n, end in zip(counts, ends, strict=True))
    body = body.to(device)
    at = 2 * tokens + rows
    index = body[at : at + rows * width].view(rows, width)
    at += rows * width
    slots = body[at : at + tokens] if access > 0 else None
    batch = PackedBatch(
        body[:tokens], body[tokens : 2 * tokens], tuple(lengths), index, slots, reads, shared
    )
    return PlanMessage(op, batch, full_logits=bool(full_logits))
