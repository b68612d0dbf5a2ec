"""The quality floor: which thresholds the scheduler may choose for a model, from the
accuracy measured on it."""

from __future__ import annotations

import json

import pytest

from dilaserve.engine import EngineConfig
from dilaserve.engine.admission import threshold_options
from dilaserve.engine.quality import allowed_thresholds, measured_accuracy, quality_floor
from dilaserve.predictor.serving import predictor_for
from dilaserve.tiny import default_model_dir

CANDIDATES = (0.5, 0.6, 0.7, 0.8, 0.9)


def test_tiny_ships_its_accuracy_and_a_three_point_floor_keeps_08_and_09():
    accuracy = measured_accuracy(default_model_dir())
    assert accuracy is not None and accuracy[0.9] > accuracy[0.5]
    assert allowed_thresholds(CANDIDATES, accuracy, 0.03) == (0.8, 0.9)
    assert allowed_thresholds(CANDIDATES, accuracy, 1.0) == CANDIDATES
    assert allowed_thresholds(CANDIDATES, accuracy, 0.0) == (0.9,)


def test_floor_is_relative_to_the_top_candidate():
    accuracy = {0.5: 0.70, 0.6: 0.80, 0.7: 0.90, 0.8: 0.93}
    assert allowed_thresholds((0.8, 0.5, 0.7, 0.6), accuracy, 0.05) == (0.7, 0.8)


def test_bad_floors_and_unmeasured_thresholds_are_errors():
    with pytest.raises(ValueError, match="no measured accuracy for thresholds \\[0.55\\]"):
        allowed_thresholds((0.55, 0.9), {0.9: 1.0}, 0.03)
    with pytest.raises(ValueError, match="negative"):
        allowed_thresholds(CANDIDATES, {t: 1.0 for t in CANDIDATES}, -0.01)


def test_no_floor_without_measurements_or_when_turned_off(tmp_path):
    assert quality_floor(CANDIDATES, tmp_path, 0.03) == CANDIDATES
    assert quality_floor(CANDIDATES, default_model_dir(), None) == CANDIDATES
    (tmp_path / "progress.json").write_text(
        json.dumps({"thresholds": list(CANDIDATES), "accuracy": [0.5, 0.6, 0.7, 0.8, 0.81]})
    )
    assert quality_floor(CANDIDATES, tmp_path, 0.03) == (0.8, 0.9)


def test_planner_options_are_the_served_thresholds_not_the_whole_rate_table():
    # dilaserve-tiny's rate table also measures τ 1.0; the planner's top option and the
    # default SLO's unit used to be τ 1.0 (2.1 tokens per step) instead of 0.9.
    rates = predictor_for(default_model_dir()).rates
    assert max(t for t, _ in rates) == 1.0
    options = threshold_options(EngineConfig(predictor_rates=rates, thresholds=(0.8, 0.9)))
    assert [o.threshold for o in options] == [0.8, 0.9]
    assert options[-1].tokens_per_step == dict(rates)[0.9]
    between = threshold_options(EngineConfig(predictor_rates=rates, thresholds=(0.85,)))
    assert dict(rates)[0.9] < between[0].tokens_per_step < dict(rates)[0.8]


def test_engine_serves_tiny_with_the_floor(shared_engine):
    assert shared_engine.engine.scheduler.thresholds == [0.8, 0.9]
