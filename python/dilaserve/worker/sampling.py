"""The decoding options beside the threshold rule: temperature sampling and the fixed
steps-per-block schedule, as LLaDA's and Fast-dLLM's released generate functions apply them.

Temperature: each position's token is the argmax of its logits plus temperature-scaled
Gumbel noise, drawn in float64 (LLaDA's `add_gumbel_noise`: `exp(logits) / (-log u)^T`,
the same argmax); the confidence that ranks positions stays the noiseless softmax
probability of that token. Fixed schedule: a block takes exactly `steps_per_block` steps,
each committing its `k` most confident candidates (`RequestState.transfer_count`).
"""

from __future__ import annotations

import torch


def gumbel_scores(
    logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids `x0` `[b, m]` and their noiseless confidences, for logits `[b, m, vocab]`
    and per-row `temperature` `[b]` (0: the argmax, lowest id on ties)."""
    scores = logits.double()
    u = torch.rand(scores.shape, dtype=torch.float64, device=scores.device, generator=generator)
    noise = -torch.log(-torch.log(u))
    x0 = (scores + temperature.double()[:, None, None] * noise).argmax(dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)
    return x0, probs.gather(-1, x0[..., None]).squeeze(-1)


def top_k_commit(
    confidence: torch.Tensor, candidate: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """`[b, m]` flags of each row's `counts[i]` most confident candidates (ties: lowest
    position), as the fixed schedule commits them."""
    scores = torch.where(candidate, confidence, -torch.inf)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return candidate & (rank < counts[:, None])
