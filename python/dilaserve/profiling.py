"""`dilaserve profile`: measure per-step latency and write the latency-profile JSON.

The Rust core reads the file (`LatencyProfile`) and every latency estimate of the scheduler
and planner interpolates in it (DESIGN §2). Steps are timed through the same `StepRunner`
that serves requests, so the profile includes the runner's own overhead.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dilaserve._core import LatencyProfile
from dilaserve.worker.runner import StepRunner
from dilaserve.worker.state import RequestState, StepKind

DEFAULT_TOKEN_GRID = (32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class ProfileSettings:
    block_length: int = 32
    token_grid: Sequence[int] = DEFAULT_TOKEN_GRID
    # Longest sequence of one profiled request; larger batch-token counts use more requests.
    max_request_tokens: int = 512
    # Sequence length of the requests whose cache steps are timed (their attention span).
    cache_context: int = 256
    repeats: int = 5
    tp: int = 1


def measure_profile(model: torch.nn.Module, settings: ProfileSettings) -> dict:
    """Times no-cache, recompute and cache steps over the token grid; returns the JSON dict."""
    tables = [
        {
            "tp": settings.tp,
            "kind": kind.value,
            "points": [[tokens, _time_step(model, kind, tokens, settings)] for tokens in grid],
        }
        for kind, grid in _grids(settings)
    ]
    param = next(model.parameters())
    return {
        "version": 1,
        "model": getattr(model.config, "name", model.config.family),
        "device": _device_name(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "block_length": settings.block_length,
        "tables": tables,
    }


def write_profile(profile: dict, path: str) -> LatencyProfile:
    """Writes the profile after the Rust loader has accepted it."""
    text = json.dumps(profile)
    loaded = LatencyProfile.from_json(text)
    with open(path, "w") as f:
        f.write(text + "\n")
    return loaded


def _grids(settings: ProfileSettings) -> Iterator[tuple[StepKind, list[int]]]:
    b = settings.block_length
    full = sorted({t for t in settings.token_grid if t > b})
    yield StepKind.NO_CACHE, full
    yield StepKind.RECOMPUTE, full
    # A cache step feeds B tokens per request, so only multiples of B are reachable.
    yield StepKind.CACHE, sorted({max(b, t - t % b) for t in settings.token_grid})


def _requests(tokens: int, kind: StepKind, s: ProfileSettings) -> list[tuple[int, int]]:
    """(prompt length, output length) of requests whose step feeds `tokens` batch tokens."""
    b = s.block_length
    if kind is StepKind.CACHE:
        return [(max(1, s.cache_context - b), b)] * (tokens // b)
    count = -(-tokens // s.max_request_tokens)
    per = tokens // count
    return [(per - b, b)] * count


def _time_step(model: torch.nn.Module, kind: StepKind, tokens: int, s: ProfileSettings) -> float:
    shapes = _requests(tokens, kind, s)
    cache = "none" if kind is StepKind.NO_CACHE else "dual"
    runner = StepRunner(
        model,
        cache=cache,
        max_requests=len(shapes),
        max_seq_len=max(p + o for p, o in shapes),
    )
    samples = []
    for trial in range(s.repeats + 1):  # the first run warms up and is dropped
        ids = [f"{trial}-{i}" for i in range(len(shapes))]
        for rid, (p, o) in zip(ids, shapes, strict=True):
            runner.add(
                RequestState.new(
                    rid,
                    [1] * p,
                    o,
                    block_length=s.block_length,
                    mask_token_id=model.config.mask_token_id,
                )
            )
        batch = [(rid, 1.0) for rid in ids]
        if kind is StepKind.CACHE:
            runner.step(batch)  # the recompute step that fills the cache
        _synchronize()
        start = time.perf_counter()
        runner.step(batch)
        _synchronize()
        if trial:
            samples.append(time.perf_counter() - start)
        for rid in ids:
            runner.release(rid)
    return statistics.median(samples)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
