"""Argument types the subcommands share: comma-separated numbers, and rates or durations,
which must be positive and finite (a zero or negative rate would never end a run)."""

from __future__ import annotations

import argparse
import math


def floats(text: str) -> list[float]:
    """Comma-separated numbers."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def positive_float(text: str) -> float:
    """A number above zero and finite."""
    (value,) = positive_floats(text)
    return value


def positive_floats(text: str) -> list[float]:
    """Comma-separated numbers, each above zero and finite."""
    values = floats(text)
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected positive finite numbers, got {text!r}")
    return values
