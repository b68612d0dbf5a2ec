"""The step predictor (DESIGN §3): remaining denoising steps of a request at each threshold.

- `features`: the 11 features from a request's state (the Rust core computes the same);
- `collect`: decoding traces of a model under every threshold, to Parquet;
- `train`: LightGBM boosters of remaining steps and remaining recompute steps, saved as
  `predictor.txt` / `predictor_recompute.txt` in the checkpoint directory;
- `calibrate`: the mean-rate table (`predictor_rates.json`) of a model without boosters;
- `evaluate`: error as the scheduler sees it (refresh intervals, one-shot);
- `native`: the Rust predictors (`GbmPredictor`, `MeanRatePredictor`, `Forest`).

Inference runs in the Rust core; training and collection are Python.
"""

from dilaserve.predictor.features import FEATURE_NAMES
from dilaserve.predictor.native import (
    Forest,
    GbmPredictor,
    MeanRatePredictor,
    PredictorError,
    PredictorModelError,
    PythonPredictor,
    StepsLeft,
)

__all__ = [
    "FEATURE_NAMES",
    "Forest",
    "GbmPredictor",
    "MeanRatePredictor",
    "PredictorError",
    "PredictorModelError",
    "PythonPredictor",
    "StepsLeft",
]
