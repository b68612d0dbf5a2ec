"""Which predictor serves a model: boosters, else the measured table, else a warning."""

from __future__ import annotations

import logging

from dilaserve.predictor.calibrate import RateTable
from dilaserve.predictor.serving import predictor_for
from dilaserve.tiny import default_model_dir


def test_embedded_model_serves_its_boosters_and_table(caplog):
    with caplog.at_level(logging.WARNING):
        served = predictor_for(default_model_dir())
    assert served.model == default_model_dir() / "predictor.txt"
    assert served.rates is not None and dict(served.rates)[0.9] > 8.0  # not GSM8K's 3.25
    assert not caplog.records


def test_a_model_without_boosters_uses_its_table_and_says_so(tmp_path, caplog):
    RateTable(((0.5, 12.0), (0.9, 4.0)), 32, 10).save(tmp_path / "predictor_rates.json")
    with caplog.at_level(logging.WARNING):
        served = predictor_for(tmp_path)
    assert served.model is None and served.rates == ((0.5, 12.0), (0.9, 4.0))
    assert "predictor.txt" in caplog.text and "mean-rate table measured" in caplog.text


def test_a_bare_model_falls_back_with_a_warning_naming_both(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        served = predictor_for(tmp_path)
    assert served == type(served)(None, None)
    assert "predictor.txt" in caplog.text and "predictor_rates.json" in caplog.text
    assert "dilaserve predictor calibrate" in caplog.text


def test_explicit_rates_win(caplog):
    with caplog.at_level(logging.WARNING):
        served = predictor_for(default_model_dir(), ((0.9, 5.0),))
    assert served.model is None and served.rates == ((0.9, 5.0),)
    assert not caplog.records
