"""The per-row confidence statistics a step reports (DESIGN §3: the step predictor's
features), computed on the host.

The runner reads each step's confidences back with its committed tokens, so the
statistics cost a few numpy operations on a `[b, m]` array instead of a dozen device ops
per step (on a CPU, torch's fixed cost per op made `torch.nanquantile` alone a tenth of a
small model's step).
"""

from __future__ import annotations

import numpy as np

#: Quantile levels of the statistics (the minimum is level 0).
LEVELS = np.array([0.0, 0.25, 0.5, 0.75])


def confidence_stats(confidence: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """`[b, 5]` (min, q25, median, mean, q75) of each row's candidate confidences, the
    quantiles interpolated linearly between order statistics as `torch.quantile` does; NaN
    for a row without candidates."""
    count = candidate.sum(axis=1)
    some = count > 0
    # Candidates first, in order; a row without any reads zeros (its NaN is set last).
    ordered = np.sort(np.where(candidate, confidence, np.inf), axis=1)
    ordered[~some] = 0.0
    rank = np.maximum(count - 1, 0)[:, None] * LEVELS
    below = np.floor(rank)
    rows = np.arange(len(count))[:, None]
    low = ordered[rows, below.astype(np.intp)]
    high = ordered[rows, np.ceil(rank).astype(np.intp)]
    quantiles = low + (high - low) * (rank - below)
    mean = np.where(candidate, confidence, 0.0).sum(axis=1) / np.maximum(count, 1)
    stats = np.column_stack([quantiles[:, :3], mean, quantiles[:, 3]])
    stats[~some] = np.nan
    return stats
