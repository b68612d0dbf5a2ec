"""Dream's generation rules as request options: which confidence orders the masked
positions (its `alg`), the top-p / top-k filters, and its timestep schedule.

Dream's released `generate` (`generation_utils.py` of the Dream-v0 checkpoints) draws each
position's token from the temperature-scaled, top-p/top-k-filtered distribution and scores
the position by one of four rules; a step commits the best-scored positions, as many as its
timestep grid says (`dream_step`). The rules are model-agnostic, so LLaDA requests may use
them too. One definition here serves the HTTP front end, the engine and the workers.
"""

from __future__ import annotations

import enum
import functools
import math

import numpy as np

#: The end of Dream's timestep grid: `linspace(1, eps, steps + 1)` (its default `eps`).
DREAM_EPS = 1e-3


class ConfidenceRule(enum.StrEnum):
    """Dream's `alg`: the score that orders masked positions and that τ is compared with."""

    #: The chosen token's probability (MaskGIT's confidence).
    PROBABILITY = "maskgit_plus"
    #: Top-1 minus top-2 probability.
    MARGIN = "topk_margin"
    #: Negative entropy of the position's distribution; τ compares exp(−entropy).
    ENTROPY = "entropy"
    #: No score: positions unmask in random order (Dream's default, `origin`).
    RANDOM = "origin"


RULE_NAMES = tuple(rule.value for rule in ConfidenceRule)


#: Seeds are 64-bit signed integers, as OpenAI's API and torch's generators take them.
SEED_RANGE = (-(2**63), 2**63 - 1)


def option_problem(
    *,
    alg: str | None,
    alg_temp: float,
    top_p: float,
    top_k: int | None,
    seed: int | None = None,
) -> tuple[str, str] | None:
    """The first invalid option as (parameter, message), None when all are valid: the one
    rule behind the HTTP 400s, `GenerationParams` and the token state's validation."""
    if alg is not None and alg not in RULE_NAMES:
        return "alg", f"alg must be one of {', '.join(RULE_NAMES)}, got {alg!r}"
    if not 0.0 <= top_p <= 1.0:
        return "top_p", f"top_p must be in [0, 1], got {top_p}"
    if top_k is not None and top_k < 1:
        return "top_k", f"top_k must be a positive integer, got {top_k}"
    if not (math.isfinite(alg_temp) and alg_temp >= 0.0):
        return "alg_temp", f"alg_temp must be a non-negative number, got {alg_temp}"
    if alg_temp > 0.0 and alg in (None, ConfidenceRule.RANDOM):
        return "alg_temp", (
            "alg_temp randomises a confidence order: it needs alg maskgit_plus, topk_margin "
            "or entropy"
        )
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        return "seed", f"seed must be a 64-bit signed integer, got {seed}"
    return None


@functools.lru_cache(maxsize=64)
def dream_timesteps(steps: int) -> tuple[float, ...]:
    """Dream's grid for `steps` steps, `torch.linspace(1, eps, steps + 1)` in float32 as its
    generate computes it (the transfer counts are truncated products of these values).
    Torch is imported here, not at module level, so that the scheduler and simulator side of
    the package (which shares these rules) loads without it."""
    import torch

    return tuple(torch.linspace(1.0, DREAM_EPS, steps + 1, dtype=torch.float32).tolist())


def dream_transfer_count(steps: int, index: int, masked: int) -> int:
    """Positions Dream's step `index` (of `steps`) commits when `masked` are masked:
    `int(masked * (1 - s / t))` in float32, everything left on the last step."""
    if index >= steps - 1:
        return masked
    grid = dream_timesteps(steps)
    t, s = np.float32(grid[index]), np.float32(grid[index + 1])
    return int(np.float32(masked) * (np.float32(1.0) - s / t))


def dream_step(steps: int, index: int, masked: int) -> tuple[int, int]:
    """(grid index, count) of the next step at or after grid step `index` that commits
    something. A step Dream runs with a count of 0 changes no token (the model sees no
    timestep), so skipping it leaves the outcome as Dream's and saves a model call."""
    for step in range(index, steps - 1):
        count = dream_transfer_count(steps, step, masked)
        if count:
            return step, count
    return max(steps - 1, index), masked
