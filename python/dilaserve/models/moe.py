"""The mixture-of-experts MLP of LLaDA2.x: a sigmoid router with group-limited top-k
choice, routed SwiGLU experts, and shared experts every token passes through.

Under tensor parallelism every expert is split like the dense MLP — gate and up by
columns, down by rows — rather than assigned whole to ranks: each rank then does the same
share of every token's work whatever the router picks (no rank idles while another holds
the popular experts, and no tokens move between ranks), and the block still ends in the
one all-reduce a dense MLP ends in, over the sum of routed and shared partials.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .parallel import Collective


class Expert(nn.Module):
    """A SwiGLU FFN without bias whose output, under tensor parallelism, is this rank's
    partial sum (the block all-reduces once for all experts)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Router(nn.Module):
    """Scores every expert with a sigmoid (in float32). `expert_bias` (load balancing)
    shifts which experts are chosen but not their weights; the choice is the `top_k` best
    within the `topk_group` groups whose two best experts score highest."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.expert_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts `[T, top_k]` and their float32 weights `[T, top_k]`."""
        moe = self.moe
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        routing = scores + self.expert_bias.float()
        t = routing.shape[0]
        grouped = routing.view(t, moe.n_group, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        allowed = allowed[:, :, None].expand_as(grouped).reshape(t, -1)
        chosen = routing.masked_fill(~allowed, float("-inf")).topk(moe.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if moe.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * moe.routed_scaling_factor


class MixtureOfExperts(nn.Module):
    """Routed experts weighted by the router, plus the shared experts, summed."""

    def __init__(self, hidden: int, moe: MoEConfig, group: Collective | None = None) -> None:
        super().__init__()
        world = 1 if group is None else group.world_size
        self.group = None if world == 1 else group
        self.router = Router(hidden, moe)
        self.experts = nn.ModuleList(
            Expert(hidden, moe.expert_inner // world) for _ in range(moe.num_experts)
        )
        self.shared = Expert(hidden, moe.shared_inner // world) if moe.shared_inner else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.router(x)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # Host-side loop over the experts some token chose: one gather and GEMM each.
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out = self.experts[e](x[rows]).float() * weights[rows, slot, None]
            routed = routed.index_add(0, rows, out)
        y = routed.to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.group is not None:
            self.group.all_reduce(y)
        return y
