"""The packed step plan rank 0 of a tensor-parallel instance broadcasts to the other
ranks: a fixed-size int64 header saying what to do, then one int64 body holding every
tensor of the step's model calls back to back.

Packed records rather than pickled objects: two broadcasts of flat tensors per step, no
Python objects on the wire, and a receiver that knows the body's size from the header.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dilaserve.worker.forward import ForwardGroup

#: int64 slots of a header: op, group count, then (rows, fed width, logits width, cache
#: access) per group.
HEADER_LEN = 12
MAX_GROUPS = 2
_ACCESS = ("off", "write", "read")


class PlanOp(enum.IntEnum):
    """What the other ranks do next."""

    STEP = 1  # run the step's model calls and contribute vocabulary partials
    POOL = 2  # (re)allocate the KV pool: header holds slots, max length
    STOP = 3  # leave the group


@dataclass(frozen=True)
class PlanMessage:
    op: PlanOp
    groups: list[ForwardGroup]
    pool_slots: int = 0
    pool_len: int = 0


def header(op: PlanOp, *values: int) -> torch.Tensor:
    out = torch.zeros(HEADER_LEN, dtype=torch.int64)
    out[0] = int(op)
    out[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return out


def pack_step(groups: Sequence[ForwardGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, body) of a step; both on the CPU."""
    if not 0 < len(groups) <= MAX_GROUPS:
        raise ValueError(f"a step has 1 to {MAX_GROUPS} model calls, got {len(groups)}")
    shape: list[int] = [len(groups)]
    parts: list[torch.Tensor] = []
    for g in groups:
        b, n = g.ids.shape
        shape += [b, n, g.logits_index.shape[1], _ACCESS.index(g.cache_mode)]
        parts += [g.ids, g.positions, g.valid, g.logits_index]
        if g.cache_mode != "off":
            parts.append(_required(g.cache_rows, "cache_rows"))
        if g.cache_mode == "read":
            parts.append(_required(g.cache_len, "cache_len"))
    body = torch.cat([p.reshape(-1).to(device="cpu", dtype=torch.int64) for p in parts])
    return header(PlanOp.STEP, *shape), body


def body_length(head: torch.Tensor) -> int:
    """int64 entries of the body that follows `head`."""
    if PlanOp(int(head[0])) is not PlanOp.STEP:
        return 0
    total = 0
    for i in range(int(head[1])):
        b, n, m, access = (int(x) for x in head[2 + 4 * i : 6 + 4 * i])
        total += 3 * b * n + b * m + b * (access > 0) + b * (access == 2)
    return total


def unpack(head: torch.Tensor, body: torch.Tensor, device: torch.device) -> PlanMessage:
    """The message of a received (header, body), tensors on `device`."""
    op = PlanOp(int(head[0]))
    if op is PlanOp.POOL:
        return PlanMessage(op, [], pool_slots=int(head[1]), pool_len=int(head[2]))
    if op is PlanOp.STOP:
        return PlanMessage(op, [])
    body = body.to(device)
    groups = []
    at = 0

    def take(count: int, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal at
        part = body[at : at + count].view(shape)
        at += count
        return part

    for i in range(int(head[1])):
        b, n, m, access = (int(x) for x in head[2 + 4 * i : 6 + 4 * i])
        ids = take(b * n, (b, n))
        positions = take(b * n, (b, n))
        valid = take(b * n, (b, n)).bool()
        index = take(b * m, (b, m))
        rows = take(b, (b,)) if access > 0 else None
        length = take(b, (b,)) if access == 2 else None
        groups.append(
            ForwardGroup(ids, positions, valid, index, _ACCESS[access], rows, length)  # type: ignore[arg-type]
        )
    return PlanMessage(op, groups)


def _required(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"a cached model call needs {name}")
    return tensor
