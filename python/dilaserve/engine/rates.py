"""Tokens per step per threshold of the served model, learned from the steps it serves.

A checkpoint without a measured rate table (`predictor_rates.json`) is served with
Fast-dLLM's GSM8K figures, which describe LLaDA-8B on maths, not this model: default SLOs
(a multiple of the latency alone at the top threshold) and the mean-rate predictor are then
off by the ratio of the two rates. The engine records every step's commits under the τ it
ran; once a threshold has `MIN_STEPS` steps its measured mean replaces the assumption, and
thresholds not yet measured take the assumption scaled by how far off it was where measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

#: Steps at one threshold before its measured mean replaces the assumed rate.
MIN_STEPS = 200
#: Recorded steps between two revisions of the table.
REVISE_EVERY = 100


class OnlineRates:
    """Learns the rates of the candidate thresholds; `assumed` gives each candidate's
    assumed tokens per step (`admission.threshold_options` interpolates them)."""

    def __init__(self, assumed: Sequence[tuple[float, float]]):
        self.assumed = dict(sorted(assumed))
        self.thresholds = tuple(self.assumed)
        self._steps = dict.fromkeys(self.thresholds, 0)
        self._tokens = dict.fromkeys(self.thresholds, 0)
        self._since_revision = 0
        #: The current table, `(τ, tokens per step)` ascending; the assumption until learned.
        self.table = tuple(self.assumed.items())

    def record(self, tau: float, steps: int, committed: int) -> bool:
        """Counts `steps` request steps at `tau` that committed `committed` tokens in all;
        returns whether the table was revised."""
        if tau not in self._steps:
            return False  # a pinned τ between the candidates
        self._steps[tau] += steps
        self._tokens[tau] += committed
        self._since_revision += steps
        if self._since_revision < REVISE_EVERY:
            return False
        self._since_revision = 0
        table = self._learned()
        if table == self.table:
            return False
        self.table = table
        return True

    @property
    def measured(self) -> tuple[float, ...]:
        """Thresholds whose rate is measured on this model."""
        return tuple(t for t in self.thresholds if self._steps[t] >= MIN_STEPS)

    def _learned(self) -> tuple[tuple[float, float], ...]:
        measured = self.measured
        if not measured:
            return self.table
        assumed = self.assumed
        scale = median(self._tokens[t] / self._steps[t] / assumed[t] for t in measured)
        rates = {
            t: self._tokens[t] / self._steps[t] if t in measured else scale * assumed[t]
            for t in self.thresholds
        }
        # A higher threshold never commits more per step: keep the table monotone.
        ordered, floor = [], 1.0
        for t in reversed(self.thresholds):
            floor = max(floor, rates[t])
            ordered.append((t, floor))
        return tuple(reversed(ordered))
