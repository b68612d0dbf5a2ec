"""Shared fixtures: the shipped traces of dilaserve-tiny and its shipped boosters."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dilaserve.predictor.collect import load
from dilaserve.predictor.train import RECOMPUTE_MODEL, TOTAL_MODEL, Split, TrainConfig
from dilaserve.tiny import default_model_dir

DATA = Path(__file__).parent / "data" / "tiny_traces.parquet"


@pytest.fixture(scope="session")
def traces() -> pa.Table:
    return load(DATA)


@pytest.fixture(scope="session")
def heldout(traces: pa.Table) -> pa.Table:
    """The prompts `dilaserve predictor train` held out from the shipped boosters."""
    return traces.filter(Split.of(traces, TrainConfig()).heldout)


@pytest.fixture(scope="session")
def shipped() -> tuple[Path, ...]:
    """The shipped boosters (dilaserve-tiny ships no recompute booster: see `train`)."""
    d = default_model_dir()
    return tuple(p for p in (d / TOTAL_MODEL, d / RECOMPUTE_MODEL) if p.is_file())
