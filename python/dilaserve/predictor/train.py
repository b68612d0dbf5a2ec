"""LightGBM regressors of remaining steps, trained on collected traces (DESIGN §3).

Two boosters, both on the same features with the threshold among them:

- `predictor.txt` predicts the remaining steps of a request (all kinds);
- `predictor_recompute.txt` predicts how many of them run over the full sequence
  (recompute steps: one per block still to open, fewer when EOS ends the request early).

The scheduler's cache steps are the difference. The recompute booster is kept only if it
beats counting one recompute step per block still to open (what the Rust predictor does
without it) on the held-out prompts: for a model that decodes every block offered, the
count is exact and the booster only costs time. Only `labeled` rows train (every step
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
    # The scheduler walks every tree for every request it refreshes: few, shallow trees.
    # On dilaserve-tiny's traces 20 trees of depth <= 6 err 6 % more than 52 unbounded
    # ones (held-out MAE 0.79 vs 0.75 steps) at less than half the inference time.
    num_leaves: int = 31
    max_depth: int = 6
    learning_rate: float = 0.3
    #: Most trees of the remaining-steps booster, and of the recompute booster.
    max_rounds: int = 20
    recompute_rounds: int = 20
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
            "max_depth": self.max_depth,
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


def structural_recompute(table: pa.Table) -> np.ndarray:
    """Recompute steps left if every block offered is decoded: one per block after the
    current one, plus one if the next step opens (or re-opens) the current block."""
    col = {n: table.column(n).to_numpy() for n in ("output_length", "block_length")}
    unmasked = table.column("unmasked").to_numpy() - table.column("unmasked_in_block").to_numpy()
    current = unmasked // col["block_length"]
    due = table.column("next_full").to_numpy(zero_copy_only=False).astype(np.int64)
    return col["output_length"] // col["block_length"] - current - 1 + due


@dataclass
class TrainResult:
    total: lgb.Booster
    #: None when counting blocks predicts recompute steps at least as well.
    recompute: lgb.Booster | None
    #: Held-out error by target (`total`, `recompute`, `recompute_structural`).
    heldout: dict[str, Errors]
    split: Split

    def save(self, directory: str | Path) -> tuple[Path, Path | None]:
        """Writes `predictor.txt` and `predictor_recompute.txt` (removing a stale one when
        there is no recompute booster)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        total, recompute = directory / TOTAL_MODEL, directory / RECOMPUTE_MODEL
        self.total.save_model(str(total), num_iteration=self.total.best_iteration or None)
        if self.recompute is None:
            recompute.unlink(missing_ok=True)
            return total, None
        self.recompute.save_model(
            str(recompute), num_iteration=self.recompute.best_iteration or None
        )
        return total, recompute


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
    truth = table.column(TARGETS["recompute"]).to_numpy()[rows]
    err = np.abs(structural_recompute(table)[rows] - truth)
    scale = table.column("remaining_steps").to_numpy()[rows]
    heldout["recompute_structural"] = Errors(
        float(err.mean()), float((err / scale).mean()), int(err.size)
    )
    keep = heldout["recompute"].mae < heldout["recompute_structural"].mae
    return TrainResult(boosters["total"], boosters["recompute"] if keep else None, heldout, split)
