"""`dilaserve profile`: measure per-step latency and write the latency-profile JSON.

The Rust core reads the file (`LatencyProfile`) and every latency estimate of the scheduler
and planner interpolates in it (DESIGN §2). Steps are timed through the same `StepRunner`
that serves requests, so the profile includes the runner's own overhead; a TP-d table is
timed on a real TP-d instance (d local rank processes, `measure_degrees`), collectives
included.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dilaserve._core import LatencyProfile
from dilaserve.models import check_degree, load_model, read_config
from dilaserve.models.config import ModelConfig
from dilaserve.protocol import RequestState, StepEntry, StepKind
from dilaserve.worker.local_group import run_on_group
from dilaserve.worker.runner import StepRunner

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


def measure_degrees(
    model_dir: str | Path,
    degrees: Sequence[int],
    settings: ProfileSettings,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    timeout_s: float = 3600.0,
) -> dict:
    """One profile with a table set per TP degree: TP 1 in this process, TP d on d local
    ranks (on CUDA, devices `cuda:0 .. cuda:d-1`). Every degree is checked against the
    model before anything is measured."""
    _, config = read_config(model_dir)
    for degree in degrees:
        check_degree(config, degree, Path(model_dir) / "config.json")
    profiles = []
    for degree in sorted(set(degrees)):
        at_degree = replace(settings, tp=degree)
        if degree == 1:
            model = load_model(model_dir, dtype=dtype, device=device)
            profiles.append(measure_profile(model, at_degree))
            del model
            continue
        profiles.append(
            run_on_group(
                degree,
                model_dir,
                measure_profile,
                at_degree,
                dtype=dtype,
                devices=_rank_devices(device, degree),
                threads=threads,
                timeout_s=timeout_s,
            )
        )
    return merge_profiles(profiles)


def merge_profiles(profiles: Sequence[dict]) -> dict:
    """The tables of several single-degree profiles of one model in one profile."""
    if not profiles:
        raise ValueError("no profiles to merge")
    merged = dict(profiles[0])
    merged["tables"] = [table for p in profiles for table in p["tables"]]
    return merged


def _rank_devices(device: str, degree: int) -> list[str]:
    if torch.device(device).type != "cuda":
        return [device] * degree
    available = torch.cuda.device_count()
    if available < degree:
        raise ValueError(f"TP {degree} needs {degree} GPUs, this machine has {available}")
    return [f"cuda:{i}" for i in range(degree)]


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


class ProfileError(ValueError):
    """The model kept finishing the blocks whose cache steps were to be timed (a `ValueError`:
    the command line reports it as bad input)."""


# Fresh random prompts tried per timed cache step before giving up (see `_add_requests`).
FILL_ATTEMPTS = 8


def _time_step(model: torch.nn.Module, kind: StepKind, tokens: int, s: ProfileSettings) -> float:
    shapes = _requests(tokens, kind, s)
    runner = StepRunner(
        model,
        cache="none" if kind is StepKind.NO_CACHE else "dual",
        max_requests=len(shapes),
        max_seq_len=max(p + o for p, o in shapes),
    )
    rng = random.Random(tokens)
    samples = []
    for trial in range(s.repeats + 1):  # the first run warms up and is dropped
        ids = _add_requests(runner, kind, shapes, s, rng, tag=trial)
        batch = [StepEntry(rid, 1.0, kind) for rid in ids]
        _synchronize()
        start = time.perf_counter()
        runner.step(batch)
        _synchronize()
        if trial:
            samples.append(time.perf_counter() - start)
        for rid in ids:
            runner.release(rid)
    return statistics.median(samples)


def _add_requests(
    runner: StepRunner,
    kind: StepKind,
    shapes: list[tuple[int, int]],
    s: ProfileSettings,
    rng: random.Random,
    tag: int,
) -> list[int]:
    """Adds requests whose next step is of `kind`; returns their ids.

    Prompts are random token ids, which leave a trained model unsure of its answer. For a
    cache step the recompute step that fills the cache runs first at τ = 1.0; a model can
    still be certain of a whole block and finish it there, leaving no cache step to time,
    so then the requests are drawn again.
    """
    config = runner.model.config
    for attempt in range(FILL_ATTEMPTS):
        ids = [(tag * FILL_ATTEMPTS + attempt) * len(shapes) + i for i in range(len(shapes))]
        for rid, (p, o) in zip(ids, shapes, strict=True):
            prompt = [_random_token(rng, config) for _ in range(p)]
            runner.add(
                RequestState.new(
                    rid, prompt, o, block_length=s.block_length, mask_token_id=config.mask_token_id
                )
            )
        if kind is not StepKind.CACHE:
            return ids
        runner.step([StepEntry(rid, 1.0, StepKind.RECOMPUTE) for rid in ids])
        if all(runner.next_kind(rid) is kind for rid in ids):
            return ids
        for rid in ids:
            runner.release(rid)
    raise ProfileError(
        f"the model finished a {s.block_length}-token block in one step for {FILL_ATTEMPTS} "
        "random prompts in a row, so no cache step could be timed"
    )


def _random_token(rng: random.Random, config: ModelConfig) -> int:
    """A token id of the vocabulary other than the mask token."""
    token = rng.randrange(config.vocab_size - 1)
    return token + (token >= config.mask_token_id)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
