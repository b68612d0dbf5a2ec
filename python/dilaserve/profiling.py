"""`dilaserve profile`: measure per-step latency and write the latency-profile JSON.

The Rust core reads the file (`LatencyProfile`) and every latency estimate of the scheduler
and planner interpolates in it (DESIGN §2). Steps are timed through the same `StepRunner`
that serves requests, so the profile includes the runner's own overhead; a TP-d table is
timed on a real TP-d instance (d local rank processes, `measure_degrees`), collectives
included.

A cache step feeds few tokens but attends to every cached one, so its cost grows with the
cached context at a fixed batch size: cache steps are timed at each of `cache_contexts`
(sequence tokens per request) and written as one table per context. In prefix-cache mode a
cache step feeds its block and everything after it, so the timed requests carry a suffix
and the batch-token axis counts the suffix fed.
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
from dilaserve.protocol import CacheMode, RequestState, StepEntry, StepKind
from dilaserve.worker.local_group import run_on_group
from dilaserve.worker.runner import StepRunner

DEFAULT_TOKEN_GRID = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_CACHE_CONTEXTS = (128, 512, 2048)
#: Format version written; version-1 files (no per-table context) still load.
PROFILE_VERSION = 2


@dataclass(frozen=True)
class ProfileSettings:
    block_length: int = 32
    token_grid: Sequence[int] = DEFAULT_TOKEN_GRID
    # Longest sequence of one profiled request; larger batch-token counts use more requests.
    max_request_tokens: int = 512
    # Sequence lengths of the requests whose cache steps are timed (their attention span).
    cache_contexts: Sequence[int] = DEFAULT_CACHE_CONTEXTS
    # Which cache the cache steps run: dual feeds the block, prefix the block and its
    # suffix; block (block diffusion's exact cache) the block, attending to its end.
    cache_mode: CacheMode = CacheMode.DUAL
    repeats: int = 5
    tp: int = 1

    def check(self) -> None:
        """Raises `ValueError` for settings no step can be timed with."""
        b = self.block_length
        if b <= 0 or self.repeats <= 0 or min(self.token_grid, default=0) <= 0:
            raise ValueError("--block-length, --tokens and --repeats must be positive")
        if self.cache_mode is CacheMode.NONE:
            raise ValueError("the cache mode to profile must be dual, prefix or block")
        shortest = b + 1 if self.cache_mode is CacheMode.DUAL else 2 * b
        if not self.cache_contexts or min(self.cache_contexts) < shortest:
            raise ValueError(
                f"--cache-context lengths must be at least {shortest} tokens (a prompt "
                f"token and {'two blocks' if shortest == 2 * b else 'one block'})"
            )
        if self.cache_mode is CacheMode.BLOCK and any(c % b for c in self.cache_contexts):
            raise ValueError(
                f"under the block cache --cache-context lengths must be whole {b}-token "
                "blocks (a step attends to the end of its block)"
            )


def measure_profile(model: torch.nn.Module, settings: ProfileSettings) -> dict:
    """Times no-cache and recompute steps over the token grid and cache steps over the grid
    at every cache context; returns the JSON dict."""
    tables = []
    for kind, context, grid in _grids(settings):
        table = {"tp": settings.tp, "kind": kind.value}
        if context is not None:
            table["context"] = context
        points = [_time_step(model, kind, tokens, context, settings) for tokens in grid]
        table["points"] = sorted(dict(points).items())
        tables.append(table)
    param = next(model.parameters())
    return {
        "version": PROFILE_VERSION,
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
    if config.block_size and settings.block_length != config.block_size:
        raise ValueError(
            f"this block diffusion model decodes blocks of {config.block_size} tokens, "
            f"not --block-length {settings.block_length}"
        )
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


def _grids(settings: ProfileSettings) -> Iterator[tuple[StepKind, int | None, list[int]]]:
    """(kind, cache context or None, batch-token targets) of every table to time."""
    b = settings.block_length
    full = sorted({t for t in settings.token_grid if t > b})
    yield StepKind.NO_CACHE, None, full
    yield StepKind.RECOMPUTE, None, full
    # A cache step feeds whole blocks (and, with a prefix cache, their suffixes) per request.
    for context in sorted(set(settings.cache_contexts)):
        yield StepKind.CACHE, context, sorted({max(b, t - t % b) for t in settings.token_grid})


def _requests(
    tokens: int, kind: StepKind, context: int | None, s: ProfileSettings
) -> list[tuple[int, int]]:
    """(prompt length, output length) of requests whose step feeds about `tokens` tokens."""
    b = s.block_length
    if kind is StepKind.CACHE:
        assert context is not None
        # Dual and block: one output block after the prompt. Prefix: two, so the first
        # block's cache steps also feed a one-block suffix.
        output = 2 * b if s.cache_mode is CacheMode.PREFIX else b
        fed = output
        return [(context - output, output)] * max(1, tokens // fed)
    count = -(-tokens // s.max_request_tokens)
    per = tokens // count
    if s.cache_mode is CacheMode.BLOCK:  # block diffusion prompts are whole blocks
        per = max(2 * b, per - per % b)
    return [(per - b, b)] * count


class ProfileError(ValueError):
    """The model kept finishing the blocks whose cache steps were to be timed (a `ValueError`:
    the command line reports it as bad input)."""


# Fresh random prompts tried per timed cache step before giving up (see `_add_requests`).
FILL_ATTEMPTS = 8


def _time_step(
    model: torch.nn.Module, kind: StepKind, tokens: int, context: int | None, s: ProfileSettings
) -> tuple[int, float]:
    """(batch tokens the timed step fed, its median seconds)."""
    shapes = _requests(tokens, kind, context, s)
    runner = StepRunner(
        model,
        cache="none" if kind is StepKind.NO_CACHE else s.cache_mode.value,
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
    return _fed_tokens(kind, shapes, s), statistics.median(samples)


def _fed_tokens(kind: StepKind, shapes: list[tuple[int, int]], s: ProfileSettings) -> int:
    """Tokens a step over `shapes` feeds: whole sequences, or for a cache step the first
    block plus (prefix cache) everything after it."""
    if kind is not StepKind.CACHE:
        return sum(p + o for p, o in shapes)
    return sum(o for _, o in shapes)


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
                    rid,
                    prompt,
                    o,
                    block_length=s.block_length,
                    mask_token_id=config.mask_token_id,
                    aligned=bool(config.block_size),
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
