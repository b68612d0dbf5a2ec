"""Tensor-parallel layers (Megatron-style) and the rules that say how a model splits.

A TP-d instance splits every layer over d ranks: q/k/v, gate and up are column-parallel
(each rank computes its own heads or its slice of the inner width), o and down are
row-parallel (each rank multiplies its slice and one all-reduce sums the partial outputs),
the embedding and the LM head are vocabulary-parallel (each rank holds a contiguous range of
embedding rows). The LM head returns only the rank's vocabulary shard: logits are never
gathered, the commit reduces them per shard (`dilaserve.kernels.vocab_partials`).

Models never import the worker: they talk to the group through the `Collective` protocol,
which the worker's `TensorParallelGroup` implements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .errors import CheckpointError

#: TP degrees the scheduler and planner choose among (DESIGN §7).
CANDIDATE_DEGREES = (1, 2, 4, 8)


class Collective(Protocol):
    """What a model shard needs of its tensor-parallel group."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the group, in place."""


class UnsupportedDegreeError(CheckpointError):
    """A model cannot be split over this many ranks (heads, KV heads, MLP width or the
    padded vocabulary do not divide); raised at launch, before any weight is read."""


@dataclass(frozen=True)
class Shard:
    """Which part of a tensor-parallel model a process holds."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, group: Collective | None) -> Shard:
        return cls() if group is None else cls(group.rank, group.world_size)

    def range(self, size: int) -> tuple[int, int]:
        """This rank's contiguous `[start, stop)` of a dimension of `size` (divisible)."""
        per = size // self.world_size
        return self.rank * per, (self.rank + 1) * per


def degree_problems(config: ModelConfig, degree: int) -> list[str]:
    """Why `config` cannot run on `degree` ranks (empty when it can)."""
    if degree < 1:
        return [f"TP degree must be positive, got {degree}"]
    sizes = {
        "query heads": config.num_heads,
        "KV heads": config.num_kv_heads,
        "MLP width": config.intermediate_size,
        "padded vocabulary (embedding rows)": config.embedding_rows,
    }
    if config.moe is not None:
        sizes["expert width"] = config.moe.expert_inner
        sizes["shared experts' width"] = config.moe.shared_inner
    return [f"{size} {what}" for what, size in sizes.items() if size % degree]


def allowed_degrees(
    config: ModelConfig, candidates: Sequence[int] = CANDIDATE_DEGREES
) -> tuple[int, ...]:
    """The candidate degrees `config` can be split into."""
    return tuple(d for d in candidates if not degree_problems(config, d))


def check_degree(config: ModelConfig, degree: int, source: str | Path = "config.json") -> None:
    """Raises `UnsupportedDegreeError` naming what does not divide."""
    problems = degree_problems(config, degree)
    if problems:
        allowed = ", ".join(map(str, allowed_degrees(config))) or "none"
        raise UnsupportedDegreeError(
            f"{source}: TP {degree} is impossible for this {config.family} model: "
            f"{', '.join(problems)} are not divisible by {degree} (allowed degrees: {allowed})"
        )


#: Our parameter names (by module suffix) and the dimension a rank's slice is taken along;
#: anything else (norms, the biases of row-parallel layers) is replicated.
_SPLIT = {
    "embed.weight": 0,
    "lm_head.weight": 0,
    "lm_head.bias": 0,
    "attn.q.weight": 0,
    "attn.q.bias": 0,
    "attn.k.weight": 0,
    "attn.k.bias": 0,
    "attn.v.weight": 0,
    "attn.v.bias": 0,
    "mlp.gate.weight": 0,
    "mlp.gate.bias": 0,
    "mlp.up.weight": 0,
    "mlp.up.bias": 0,
    "attn.qkv.weight": 0,
    "attn.qkv.bias": 0,
    "attn.o.weight": 1,
    "mlp.down.weight": 1,
}

#: Every expert (routed or shared) is split like the dense MLP (`moe.py` says why).
_EXPERT_SPLIT = {"gate.weight": 0, "up.weight": 0, "down.weight": 1}


def split_dim(name: str) -> int | None:
    """The dimension along which parameter `name` (e.g. `layers.3.attn.q.weight`) is split
    over the ranks, or None if every rank holds all of it."""
    for suffix, dim in _SPLIT.items():
        if name == suffix or name.endswith("." + suffix):
            return dim
    if ".experts." in name or ".shared." in name:
        for suffix, dim in _EXPERT_SPLIT.items():
            if name.endswith("." + suffix):
                return dim
    return None


def fused_segments(name: str, config: ModelConfig) -> tuple[int, ...] | None:
    """The parts of a fused tensor a rank takes its share of each of (a fused Q/K/V
    projection: queries, keys, values), or None for an ordinary tensor."""
    if not config.fused_qkv or not name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return None
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return (q, kv, kv)


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` where `x` arrives split along its last dimension: each rank
    multiplies its slice by its columns of W, one all-reduce sums the partial products, and
    the bias is added once, after the sum. Parameter names match `nn.Linear`."""

    def __init__(self, in_local: int, out: int, bias: bool, group: Collective) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out, in_local))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows `[offset, offset + rows)` on this rank: ids outside the range embed as
    zeros, and one all-reduce gives every rank the full embedding (each id is found on
    exactly one rank, so the sum is exact)."""

    def __init__(self, rows: int, hidden: int, offset: int, group: Collective) -> None:
        super().__init__()
        self.group = group
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.offset
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(inside, local, 0), self.weight)
        x = x * inside[..., None].to(x.dtype)
        self.group.all_reduce(x)
        return x
