"""Tokens and confidences beside the argmax rule, as the released generate functions apply
them, batched over rows that each carry their own options.

Tokens: the argmax of the logits plus temperature-scaled Gumbel noise, drawn in float64
(LLaDA's `add_gumbel_noise`: `exp(logits) / (-log u)^T`, the same argmax), restricted to the
tokens Dream's top-p / top-k filters keep. A Gumbel-max draw is a draw from
softmax(logits / T), which is Dream's categorical sample. Confidences: LLaDA's noiseless
softmax probability of the token, or one of Dream's scores over the scaled and filtered
distribution (`dream_scores`). Commits by count: a row's `k` best positions
(`top_k_commit`), or the random rule's first positions to fire on Dream's grid
(`first_fired`).
"""

from __future__ import annotations

import torch

# Dream's guard against log(0) in its negative entropy.
ENTROPY_EPS = 1e-10


def gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from uniforms in [0, 1)."""
    return -torch.log(-torch.log(uniform))


def kept_tokens(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """`[b, m, vocab]` flags of the tokens Dream's filters keep for temperature-scaled logits:
    the most probable tokens until their mass exceeds the row's `top_p` (the one crossing it
    kept; top_p ≥ 1 keeps all), and tokens not below the row's `top_k`-th largest logit
    (top_k 0 keeps all)."""
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    beyond = mass > top_p[:, None, None]
    # Shifted one place right: the token whose mass crosses top_p stays.
    drop = torch.cat([torch.zeros_like(beyond[..., :1]), beyond[..., :-1]], dim=-1)
    drop &= (top_p < 1.0)[:, None, None]
    vocab = scaled.shape[-1]
    kth = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab) - 1
    drop |= ordered < ordered.gather(-1, kth[:, None, None].expand(*ordered.shape[:2], 1))
    return torch.empty_like(drop).scatter_(-1, order, ~drop)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keep: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> torch.Tensor:
    """Ids `[b, m]`: the argmax over kept tokens of the logits plus `temperature` `[b]`
    times Gumbel noise from `noise` (float64 uniforms like the logits; None: the argmax,
    lowest id on ties)."""
    scores = logits.double()
    if keep is not None:
        scores = scores.masked_fill(~keep, -torch.inf)
    if noise is not None:
        scores = scores + temperature.double()[:, None, None] * gumbel(noise)
    return scores.argmax(dim=-1)


def token_probability(logits: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The noiseless softmax probability of each chosen token: LLaDA's confidence."""
    return torch.softmax(logits.float(), dim=-1).gather(-1, x0[..., None]).squeeze(-1)


def dream_scores(
    scaled: torch.Tensor, keep: torch.Tensor | None, x0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dream's three confidences `[b, m]` over the scaled, filtered distribution: the chosen
    token's probability, the top-1 minus top-2 margin, and the negative entropy."""
    if keep is not None:
        scaled = scaled.masked_fill(~keep, -torch.inf)
    probs = torch.softmax(scaled, dim=-1)
    probability = probs.gather(-1, x0[..., None]).squeeze(-1)
    top2 = probs.topk(2, dim=-1).values
    neg_entropy = (probs * torch.log(probs + ENTROPY_EPS)).sum(dim=-1)
    return probability, top2[..., 0] - top2[..., 1], neg_entropy


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


def first_fired(
    uniform: torch.Tensor, survival: torch.Tensor, candidate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random rule's step on Dream's grid, skipping the steps where nothing fires.

    Dream unmasks each masked position at grid step j with probability 1 − s_j / t_j, so
    from the current step a position is still masked after j more steps with probability
    t_(j+1) / t_now (the product telescopes): `survival` `[b, S]` holds those ratios for
    every step but the last (which takes all; padded with −inf), and a position with
    uniform draw u fires after as many steps as ratios ≥ u. The step commits the
    candidates that fire first. Returns the commit flags and the grid steps it passed."""
    fires_after = (survival[:, None, :] >= uniform[..., None]).sum(dim=-1)
    fires_after = torch.where(candidate, fires_after, survival.shape[1] + 1)
    first = fires_after.min(dim=1).values
    return candidate & (fires_after == first[:, None]), first + 1
