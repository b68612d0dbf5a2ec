"""Error of remaining-step predictions on collected traces, as the scheduler would see it.

The scheduler predicts at arrival and then, online, after every `k`-th step of a request;
between refreshes it counts each executed step off the last prediction (a cache step off
the cache steps, a full-sequence step off the recompute steps, neither below zero). So the
estimate a request has after `t` steps is the prediction made at `t0 = (t // k) * k`
less the steps run since. `refresh_estimates` replays exactly that on collected runs; a
one-shot predictor is the case `k = ∞` (`t0 = 0`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

#: `(cache, recompute)` predictions for the given rows of a table, each at its run's `tau`.
PredictRows = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]

#: Refresh intervals the benchmark and `train` compare.
REFRESH_INTERVALS: tuple[int, ...] = (1, 2, 4, 8, 16)
#: A refresh interval may cost at most this much more error than refreshing every step.
REFRESH_TOLERANCE = 0.05


@dataclass(frozen=True)
class Errors:
    mae: float
    mape: float  # mean of |error| / true remaining steps (always >= 1)
    n: int

    def to_dict(self) -> dict[str, float | int]:
        return {"mae": self.mae, "mape": self.mape, "n": self.n}


def errors(predicted: np.ndarray, truth: np.ndarray) -> Errors:
    predicted = np.asarray(predicted, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    err = np.abs(predicted - truth)
    return Errors(float(err.mean()), float((err / truth).mean()), int(truth.size))


def heldout_prompts(table: pa.Table, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the rows whose prompt is held out: every run of a prompt lands on
    the same side, so held-out error is measured on prompts the model never saw."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction}")
    prompts = table.column("prompt").to_numpy()
    unique = np.unique(prompts)
    rng = np.random.default_rng(seed)
    chosen = rng.choice(unique, size=max(1, round(fraction * unique.size)), replace=False)
    return np.isin(prompts, chosen)


def sorted_by_run(table: pa.Table) -> pa.Table:
    """Rows ordered by run, then step: what `refresh_estimates` expects."""
    return table.sort_by([("run", "ascending"), ("steps_done", "ascending")])


def refresh_estimates(
    table: pa.Table, predict: PredictRows, interval: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Remaining-step estimates of every labeled row when predictions are refreshed every
    `interval` steps (`None`: once, at arrival). Returns `(estimate, truth)` over the
    labeled rows. `table` must be sorted by run and step (`sorted_by_run`) and hold every
    step of each run it holds."""
    run = table.column("run").to_numpy()
    step = table.column("steps_done").to_numpy()
    full = table.column("next_full").to_numpy(zero_copy_only=False).astype(np.int64)
    labeled = table.column("labeled").to_numpy(zero_copy_only=False)
    if interval is not None and interval < 1:
        raise ValueError(f"refresh interval must be at least 1, got {interval}")
    t0 = np.zeros_like(step) if interval is None else (step // interval) * interval
    source = np.arange(len(step)) - (step - t0)
    if np.any(source < 0) or np.any(run[source] != run) or np.any(step[source] != t0):
        raise ValueError("table must hold every step of each run, sorted by run and step")
    rows = np.flatnonzero(labeled)
    refresh_rows = np.unique(source[rows])
    cache, recompute = predict(refresh_rows)
    at = np.searchsorted(refresh_rows, source[rows])
    # Full-sequence steps run between the refresh and each row.
    full_before = np.cumsum(full) - full
    full_run = full_before[rows] - full_before[source[rows]]
    steps_run = step[rows] - t0[rows]
    estimate = np.maximum(cache[at] - (steps_run - full_run), 0.0) + np.maximum(
        recompute[at] - full_run, 0.0
    )
    truth = table.column("remaining_steps").to_numpy()[rows].astype(np.float64)
    return estimate, truth


def refresh_errors(
    table: pa.Table, predict: PredictRows, intervals: Sequence[int | None] = REFRESH_INTERVALS
) -> dict[int | None, Errors]:
    """Error of the estimates by refresh interval (`None`: one-shot)."""
    return {k: errors(*refresh_estimates(table, predict, k)) for k in intervals}


def best_interval(
    by_interval: dict[int | None, Errors], tolerance: float = REFRESH_TOLERANCE
) -> int:
    """The largest refresh interval whose MAE stays within `tolerance` of refreshing every
    step (DESIGN §3)."""
    base = by_interval[1].mae
    ok = [k for k, e in by_interval.items() if k is not None and e.mae <= base * (1 + tolerance)]
    return max(ok)


#: Columns of a request state as the Rust predictors take them (`native.VIEW_COLUMNS`).
_STATE = (
    "prompt_length",
    "output_length",
    "block_length",
    "steps_done",
    "block_steps",
    "unmasked",
    "unmasked_in_block",
    "confidence_min",
    "confidence_q25",
    "confidence_median",
    "confidence_mean",
    "confidence_q75",
)


def table_states(table: pa.Table, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Request states of the given rows of a collected table, as the Rust predictors
    take them (`needs_recompute`: the next step runs over the full sequence)."""
    cols = {c: table.column(c).to_numpy()[rows] for c in _STATE}
    cols["needs_recompute"] = table.column("next_full").to_numpy(zero_copy_only=False)[rows]
    return cols


def row_predictor(table: pa.Table, predictor) -> PredictRows:
    """`PredictRows` through a Rust predictor (`native.GbmPredictor`, `MeanRatePredictor`):
    each row at its own run's `tau`."""
    tau = table.column("tau").to_numpy()
    thresholds = sorted(set(tau.tolist()))
    column = {t: k for k, t in enumerate(thresholds)}

    def predict(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = predictor.predict(table_states(table, rows), thresholds)
        k = np.array([column[t] for t in tau[rows]], dtype=np.int64)
        pick = np.arange(len(rows))
        return out.cache[pick, k], out.recompute[pick, k]

    return predict
