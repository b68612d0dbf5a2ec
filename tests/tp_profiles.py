"""Synthetic latency profiles with tables for several TP degrees, shaped like the tiny
model's on a CPU (TP-d a little faster per token), so serving tests never measure one."""

from __future__ import annotations

from pathlib import Path

from dilaserve.scheduler import LatencyProfile

TP1_POINTS = {
    "no_cache": [(32, 0.004), (512, 0.012), (8192, 0.15)],
    "recompute": [(32, 0.004), (512, 0.012), (8192, 0.15)],
    "cache": [(32, 0.003), (512, 0.008), (8192, 0.1)],
}
SPEEDUP = {1: 1.0, 2: 0.75, 4: 0.45, 8: 0.33}


def write_tp_profile(path: Path, degrees: tuple[int, ...] = (1, 2)) -> str:
    tables = [
        (d, kind, [(tokens, seconds * SPEEDUP[d]) for tokens, seconds in points])
        for d in degrees
        for kind, points in TP1_POINTS.items()
    ]
    path.write_text(LatencyProfile.from_tables(tables).to_json())
    return str(path)
