"""LightGBM regressors of remaining steps, trained on collected traces (DESIGN §3).

Two boosters, both on the same features with the threshold among them:

- `predictor.txt` predicts the remaining steps of a request (all kinds);
- `predictor_recompute.txt` predicts how many of them run over the full sequence
  (recompute steps: one per block still to open, fewer when EOS ends the request early).

The scheduler's cache steps are the difference. Only `labeled` rows train (every step
after them ran at the threshold the labels are for). Prompts are split three ways — train,
early-stopping validation and held out — so the printed held-out error is on prompts the
boosters never saw.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pyarrow as pa

from dilaserve.predictor.evaluate import Errors, heldout_prompts
from dilaserve.predictor.features import FEATURE_NAMES, check_feature_names, feature_matrix

log = logging.getLogger(__name__)

#: File names of the boosters inside a checkpoint directory.
TOTAL_MODEL = "predictor.txt"
RECOMPUTE_MODEL = "predictor_recompute.txt"

TARGETS: dict[str, str] = {"total": "remaining_steps", "recompute": "remaining_recompute"}


@dataclass(frozen=True)
class TrainConfig:
    features: tuple[str, ...] = FEATURE_NAMES
    objective: str = "regression"
    num_leaves: int = 31
    learning_rate: float = 0.2
    #: Most trees of the remaining-steps booster, and of the recompute booster (whose
    #: target is nearly fixed by the block structure). Fewer trees, faster scheduling.
    max_rounds: int = 60
    recompute_rounds: int = 30
    early_stopping: int = 20
    min_data_in_leaf: int = 20
    #: Share of prompts held out for the reported error, and for early stopping.
    heldout: float = 0.2
    validation: float = 0.1
    seed: int = 0
    num_threads: int = 0  # 0: LightGBM's default
    extra_params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_feature_names(self.features)
        if self.num_leaves < 2 or self.max_rounds < 1 or self.learning_rate <= 0:
            raise ValueError("num_leaves >= 2, max_rounds >= 1 and learning_rate > 0 required")

    def params(self) -> dict:
        return {
            "objective": self.objective,
            "num_leaves": self.num_leaves,
            "learning_rate": self.learning_rate,
            "min_data_in_leaf": self.min_data_in_leaf,
            "seed": self.seed,
            "deterministic": True,
            "force_row_wise": True,
            "num_threads": self.num_threads,
            "verbosity": -1,
            **self.extra_params,
        }


@dataclass
class Split:
    """Row masks of one table: train, early-stopping validation, held out."""

    train: np.ndarray
    valid: np.ndarray
    heldout: np.ndarray

    @classmethod
    def of(cls, table: pa.Table, config: TrainConfig) -> Split:
        heldout = heldout_prompts(table, config.heldout, config.seed)
        rest = table.filter(pa.array(~heldout))
        valid_rest = heldout_prompts(rest, config.validation, config.seed + 1)
        prompts = table.column("prompt").to_numpy()
        valid_prompts = np.unique(rest.column("prompt").to_numpy()[valid_rest])
        valid = np.isin(prompts, valid_prompts)
        return cls(train=~heldout & ~valid, valid=valid, heldout=heldout)


def state_columns(table: pa.Table) -> dict[str, np.ndarray]:
    return {name: table.column(name).to_numpy() for name in table.column_names}


def features_of(table: pa.Table, names: Sequence[str]) -> np.ndarray:
    """Feature rows of every row of `table`, each at its run's `tau`."""
    columns = state_columns(table)
    return feature_matrix(columns, columns["tau"], names)


def fit(
    table: pa.Table, target: str, config: TrainConfig, split: Split | None = None
) -> lgb.Booster:
    """One booster of `target` (`total` or `recompute`) on the labeled rows."""
    split = split or Split.of(table, config)
    labeled = table.column("labeled").to_numpy(zero_copy_only=False)
    x = features_of(table, config.features)
    y = table.column(TARGETS[target]).to_numpy().astype(np.float64)
    train = split.train & labeled
    valid = split.valid & labeled
    if not train.any() or not valid.any():
        raise ValueError("too few prompts to train: the train or validation split is empty")
    names = list(config.features)
    dtrain = lgb.Dataset(x[train], y[train], feature_name=names, free_raw_data=False)
    dvalid = lgb.Dataset(x[valid], y[valid], reference=dtrain, feature_name=names)
    params = config.params() | {"metric": "l1"}
    return lgb.train(
        params,
        dtrain,
        num_boost_round=config.recompute_rounds if target == "recompute" else config.max_rounds,
        valid_sets=[dvalid],
        callbacks=[lgb.early_stopping(config.early_stopping, verbose=False)],
    )


@dataclass
class TrainResult:
    total: lgb.Booster
    recompute: lgb.Booster
    heldout: dict[str, Errors]  # by target, raw booster outputs on held-out labeled rows
    split: Split

    def save(self, directory: str | Path) -> tuple[Path, Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = (directory / TOTAL_MODEL, directory / RECOMPUTE_MODEL)
        for booster, path in zip((self.total, self.recompute), paths, strict=True):
            booster.save_model(str(path), num_iteration=booster.best_iteration or None)
        return paths


def train(table: pa.Table, config: TrainConfig = TrainConfig()) -> TrainResult:
    """Fits both boosters and measures them on the held-out prompts."""
    split = Split.of(table, config)
    boosters = {t: fit(table, t, config, split) for t in TARGETS}
    labeled = table.column("labeled").to_numpy(zero_copy_only=False)
    rows = split.heldout & labeled
    x = features_of(table, config.features)[rows]
    heldout = {}
    for target, booster in boosters.items():
        truth = table.column(TARGETS[target]).to_numpy()[rows]
        predicted = booster.predict(x, num_iteration=booster.best_iteration or None)
        # Remaining recompute steps can be 0, so their error is scaled by total steps.
        scale = table.column("remaining_steps").to_numpy()[rows]
        err = np.abs(predicted - truth)
        heldout[target] = Errors(float(err.mean()), float((err / scale).mean()), int(err.size))
        log.info(
            "%s: %d trees, held-out MAE %.3f steps over %d rows",
            target,
            booster.best_iteration or booster.num_trees(),
            heldout[target].mae,
            heldout[target].n,
        )
    return TrainResult(boosters["total"], boosters["recompute"], heldout, split)
