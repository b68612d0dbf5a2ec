"""Typed face of the Rust step predictors (`dilaserve._core`).

Request states cross to Rust as packed float64 rows of `VIEW_COLUMNS`; predictions come
back as `(cache, recompute)` arrays of shape `(requests, thresholds)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from dilaserve import _core
from dilaserve._core import PredictorError, PredictorModelError

__all__ = [
    "VIEW_COLUMNS",
    "Forest",
    "GbmPredictor",
    "MeanRatePredictor",
    "PredictorError",
    "PredictorModelError",
    "PythonPredictor",
    "RequestViews",
    "StepsLeft",
    "call_python_predictor",
    "views_from_states",
]

#: Columns of a request state as predictors see it (`RequestView` in Rust).
VIEW_COLUMNS: tuple[str, ...] = tuple(_core.RequestViews.columns)

RequestViews = _core.RequestViews


class StepsLeft(NamedTuple):
    """Predicted remaining steps, each of shape `(requests, thresholds)`."""

    cache: np.ndarray
    recompute: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.cache + self.recompute


def views_from_states(states: Mapping[str, np.ndarray]) -> RequestViews:
    """Packs request-state columns (`VIEW_COLUMNS`; confidence columns NaN where unknown,
    `needs_recompute` boolean) for the Rust predictors."""
    missing = [c for c in VIEW_COLUMNS if c not in states]
    if missing:
        raise ValueError(f"request states lack columns {missing}")
    rows = np.column_stack([np.asarray(states[c], dtype=np.float64) for c in VIEW_COLUMNS])
    return RequestViews(np.ascontiguousarray(rows, dtype="<f8").tobytes())


def states_from_views(views: RequestViews) -> dict[str, np.ndarray]:
    """The columns of packed request states."""
    rows = np.frombuffer(views.packed(), dtype="<f8").reshape(-1, len(VIEW_COLUMNS))
    return {c: rows[:, j] for j, c in enumerate(VIEW_COLUMNS)}


def _unpack(packed: tuple[bytes, bytes], n: int, k: int) -> StepsLeft:
    cache, recompute = (np.frombuffer(b, dtype="<f8").reshape(n, k) for b in packed)
    return StepsLeft(cache, recompute)


def _as_views(states: Mapping[str, np.ndarray] | RequestViews) -> RequestViews:
    return states if isinstance(states, RequestViews) else views_from_states(states)


class Forest:
    """A LightGBM text model evaluated natively (equal to `lightgbm.Booster.predict`)."""

    def __init__(self, core: _core.Forest) -> None:
        self._core = core

    @classmethod
    def load(cls, path: str | Path) -> Forest:
        return cls(_core.Forest.load(str(path)))

    @classmethod
    def from_text(cls, text: str) -> Forest:
        return cls(_core.Forest.from_text(text))

    @property
    def feature_names(self) -> list[str]:
        return self._core.feature_names

    @property
    def num_trees(self) -> int:
        return self._core.num_trees

    @property
    def objective(self) -> str:
        return self._core.objective

    def predict(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] != len(self.feature_names):
            raise ValueError(f"rows must be (n, {len(self.feature_names)}), got {rows.shape}")
        out = self._core.predict(np.ascontiguousarray(rows, dtype="<f8").tobytes())
        return np.frombuffer(out, dtype="<f8")


class GbmPredictor:
    """The learned step predictor: `predictor.txt` (remaining steps) and, when present,
    `predictor_recompute.txt` (remaining recompute steps) evaluated in Rust."""

    def __init__(self, core: _core.GbmPredictor) -> None:
        self._core = core

    @classmethod
    def load(cls, path: str | Path) -> GbmPredictor:
        return cls(_core.GbmPredictor.load(str(path)))

    @classmethod
    def from_forests(cls, total: Forest, recompute: Forest | None = None) -> GbmPredictor:
        return cls(
            _core.GbmPredictor.from_forests(
                total._core, None if recompute is None else recompute._core
            )
        )

    @property
    def has_recompute_model(self) -> bool:
        return self._core.has_recompute_model

    @property
    def feature_names(self) -> list[str]:
        return self._core.feature_names

    @property
    def native(self) -> _core.GbmPredictor:
        """The Rust object (what `SchedulerConfig.predictor` may be given)."""
        return self._core

    def predict(
        self, states: Mapping[str, np.ndarray] | RequestViews, thresholds: Sequence[float]
    ) -> StepsLeft:
        views = _as_views(states)
        packed = self._core.predict(views, list(thresholds))
        return _unpack(packed, len(views), len(thresholds))


class MeanRatePredictor:
    """The mean-rate table: each τ commits a fixed mean number of tokens per step."""

    def __init__(self, points: Sequence[tuple[float, float]] | None = None) -> None:
        self._core = _core.MeanRatePredictor(None if points is None else [tuple(p) for p in points])

    @property
    def native(self) -> _core.MeanRatePredictor:
        return self._core

    def rate(self, tau: float) -> float:
        return self._core.rate(tau)

    def predict(
        self, states: Mapping[str, np.ndarray] | RequestViews, thresholds: Sequence[float]
    ) -> StepsLeft:
        views = _as_views(states)
        packed = self._core.predict(views, list(thresholds))
        return _unpack(packed, len(views), len(thresholds))


class PythonPredictor(Protocol):
    """What a predictor written in Python provides to the scheduler (for experiments).

    `states` holds `VIEW_COLUMNS` plus `request_id`, one entry per request; the answer is
    `(cache, recompute)` remaining steps, each `(requests, thresholds)`. A NaN, infinite
    or negative value, or an exception, makes the scheduler event fail with a typed error.
    """

    def predict(
        self, states: Mapping[str, np.ndarray], thresholds: Sequence[float]
    ) -> tuple[np.ndarray, np.ndarray]: ...


def call_python_predictor(
    predictor: PythonPredictor, views: RequestViews, thresholds: list[float]
) -> tuple[bytes, bytes]:
    """Called by the Rust core: runs `predictor` on packed states, packs its answer."""
    states = states_from_views(views)
    states["request_id"] = np.asarray(views.ids(), dtype=np.uint64)
    cache, recompute = predictor.predict(states, thresholds)
    shape = (len(views), len(thresholds))
    out = []
    for name, values in (("cache", cache), ("recompute", recompute)):
        array = np.asarray(values, dtype=np.float64)
        if array.shape != shape:
            raise ValueError(f"{name} predictions have shape {array.shape}, expected {shape}")
        out.append(np.ascontiguousarray(array, dtype="<f8").tobytes())
    return out[0], out[1]
