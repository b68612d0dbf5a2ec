"""The mean-rate table of a served model: measured tokens committed per step at each τ.

The scheduler's fallback predictor (`MeanRatePredictor`) assumes each threshold commits a
fixed mean number of tokens per step. Its built-in numbers are Fast-dLLM's GSM8K figures
for LLaDA; any other model commits at its own rate (`dilaserve-tiny`: 8.9 tokens per step
at τ = 0.9, not 3.25), so a model served without a learned predictor gets a table measured
on that model: output positions unmasked over steps run, per threshold, over runs decoded
at one fixed threshold. Saved as `predictor_rates.json` next to the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: File name of the table inside a checkpoint directory.
RATES_FILE = "predictor_rates.json"
RATES_FORMAT_VERSION = 1


@dataclass(frozen=True)
class RateTable:
    """`(threshold, mean tokens per step)` points, ascending in the threshold."""

    points: tuple[tuple[float, float], ...]
    block_length: int
    runs: int

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": RATES_FORMAT_VERSION,
                "block_length": self.block_length,
                "runs": self.runs,
                "points": [list(p) for p in self.points],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> RateTable:
        try:
            data = json.loads(text)
            if data.get("format") != RATES_FORMAT_VERSION:
                raise ValueError(f"format {data.get('format')!r} is not {RATES_FORMAT_VERSION}")
            points = tuple((float(t), float(r)) for t, r in data["points"])
            table = cls(points, int(data["block_length"]), int(data["runs"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed predictor rate table: {e}") from None
        if not points or any(not (0 < t <= 1 and r >= 1) for t, r in points):
            raise ValueError(f"rate table points must be (τ in (0, 1], rate >= 1): {points}")
        return table

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> RateTable:
        return cls.from_json(Path(path).read_text())


def rates_from_table(table: pa.Table, thresholds: Sequence[float] | None = None) -> RateTable:
    """Tokens per step of the fixed-threshold runs of a collected table (`collect`)."""
    first = table.filter(
        pc.and_(
            pc.equal(table.column("steps_done"), 0),
            pc.equal(table.column("switch_step"), 0),
        )
    )
    if first.num_rows == 0:
        raise ValueError("the table holds no fixed-threshold runs to calibrate from")
    tau = first.column("tau").to_numpy()
    steps = first.column("total_steps").to_numpy().astype(np.float64)
    committed = first.column("total_committed").to_numpy().astype(np.float64)
    wanted = sorted(set(tau.tolist()) if thresholds is None else thresholds)
    points = []
    for t in wanted:
        mine = tau == t
        if not mine.any():
            raise ValueError(f"no fixed-threshold runs at τ = {t}")
        points.append((float(t), max(1.0, float(committed[mine].sum() / steps[mine].sum()))))
    block = int(first.column("block_length").to_numpy()[0])
    return RateTable(tuple(points), block, int(first.num_rows))
