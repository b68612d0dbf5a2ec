"""Which step predictor serves a model: its trained boosters, else its measured mean-rate
table, else Fast-dLLM's fixed figures, with a warning naming what is missing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dilaserve.predictor.calibrate import RATES_FILE, RateTable
from dilaserve.predictor.train import TOTAL_MODEL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedPredictor:
    #: `predictor.txt` for the scheduler's learned predictor, if the model has one.
    model: Path | None
    #: Mean-rate points: explicit, or measured on the model (`predictor_rates.json`); the
    #: scheduler's predictor when there is no booster, and the rate table that admission
    #: and the planner use either way. None: Fast-dLLM's GSM8K figures.
    rates: tuple[tuple[float, float], ...] | None


def predictor_for(
    model_dir: str | Path, rates: tuple[tuple[float, float], ...] | None = None
) -> ServedPredictor:
    """The predictor for serving `model_dir`. Explicit `rates` win (the mean-rate table
    with those points); otherwise the model's `predictor.txt`, and its
    `predictor_rates.json` for the rate table."""
    model_dir = Path(model_dir)
    if rates is not None:
        log.info("step predictor: the given mean-rate table %s", rates)
        return ServedPredictor(None, tuple(rates))
    table_path = model_dir / RATES_FILE
    table = RateTable.load(table_path).points if table_path.is_file() else None
    booster = model_dir / TOTAL_MODEL
    if booster.is_file():
        log.info("step predictor: LightGBM boosters %s", booster)
        return ServedPredictor(booster, table)
    if table is not None:
        log.warning(
            "%s has no %s (train one with `dilaserve predictor collect` and `train`): the "
            "scheduler predicts remaining steps from the mean-rate table measured on this "
            "model (%s)",
            model_dir,
            TOTAL_MODEL,
            table_path.name,
        )
    else:
        log.warning(
            "%s has neither %s nor %s: the scheduler predicts remaining steps from "
            "Fast-dLLM's GSM8K tokens per step, which do not describe this model; run "
            "`dilaserve predictor calibrate --model %s` (or collect and train a predictor)",
            model_dir,
            TOTAL_MODEL,
            RATES_FILE,
            model_dir,
        )
    return ServedPredictor(None, table)
