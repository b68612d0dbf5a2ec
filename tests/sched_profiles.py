"""Latency profiles and step reports shared by the scheduler tests."""

from __future__ import annotations

from dilaserve.scheduler import Batch, LatencyProfile, StepResult

TP_SPEED = {1: 1.0, 2: 0.75, 4: 0.45}


def make_profile(degrees: tuple[int, ...] = (1, 2, 4)) -> LatencyProfile:
    """Full steps cost 20 ms + 20 µs/token on TP1, cache steps 5 ms + 10 µs/token; higher
    degrees scale both down as DESIGN §2 reports for LLaDA-8B."""
    tables = []
    for tp in degrees:
        speed = TP_SPEED[tp]
        full = [(n, (0.02 + 2e-5 * n) * speed) for n in (64, 512, 4096, 16384)]
        cache = [(n, (0.005 + 1e-5 * n) * speed) for n in (32, 256, 2048, 16384)]
        tables += [(tp, "recompute", full), (tp, "no_cache", full), (tp, "cache", cache)]
    return LatencyProfile.from_tables(tables)


def flat_profile() -> LatencyProfile:
    """TP-1 steps of 4 ms plus 1.5 µs a token: barely longer for a bigger batch, as a GPU
    at small batches."""
    pts = [(n, 0.004 + 1.5e-6 * n) for n in (32, 256, 2048, 16384)]
    return LatencyProfile.from_tables([(1, kind, pts) for kind in ("recompute", "cache")])


def report(batch: Batch, committed: int = 1) -> list[StepResult]:
    """A worker's report committing `committed` tokens for every request of `batch`."""
    return [StepResult(e.request, committed) for e in batch.entries]
